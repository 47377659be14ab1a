"""Which part a build is (``preprocess/job/part.py``): ``--part``, torchrun's rank, or a Slurm
array task's place in its array, and one-line refusals of values that would leave a cache
unfinished (issue #41). The builds themselves are in test_parts.py."""

from __future__ import annotations

import pytest

from melcache.errors import UserError
from preprocess.job.part import choose_part, slurm_array_part


def array(task: int, low: int, count: int, **extra: str) -> dict[str, str]:
    names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")
    return {**dict(zip(names, map(str, (task, low, count)), strict=True)), **extra}


@pytest.mark.parametrize(
    ("task", "low", "count", "part"),
    [(0, 0, 3, (0, 3)), (2, 0, 3, (2, 3)), (1, 1, 2, (0, 2)), (2, 1, 2, (1, 2)), (7, 5, 4, (2, 4))],
)
def test_an_array_task_is_its_place_in_the_array(
    task: int, low: int, count: int, part: tuple[int, int]
) -> None:
    """0-based and 1-based arrays (``--array=1-2``), and one starting anywhere else."""
    found, said = slurm_array_part(array(task, low, count))
    assert found == part
    assert (
        said
        == f"SLURM_ARRAY_TASK_ID={task} SLURM_ARRAY_TASK_MIN={low} SLURM_ARRAY_TASK_COUNT={count}"
    )


def test_no_array_no_part() -> None:
    assert slurm_array_part({"SLURM_JOB_ID": "7"}) is None


@pytest.mark.parametrize(
    "env",
    [
        array(3, 1, 2),  # past the last task
        array(0, 1, 2),  # before the first
        array(1, 1, 0),
        array(1, 1, 3, SLURM_ARRAY_TASK_MAX="7"),  # --array=1,4,7: ids with gaps
        array(1, 1, 3, SLURM_ARRAY_TASK_MAX="5", SLURM_ARRAY_TASK_STEP="2"),  # --array=1-5:2
        {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},  # no MIN
        array(1, 1, 2, SLURM_ARRAY_TASK_MAX="two"),
    ],
)
def test_inconsistent_array_values_are_refused_in_one_line(env: dict[str, str]) -> None:
    with pytest.raises(UserError) as caught:
        slurm_array_part(env)
    message = str(caught.value)
    assert "\n" not in message and "pass --part K/N" in message
    assert f"SLURM_ARRAY_TASK_ID={env['SLURM_ARRAY_TASK_ID']}" in message


def test_part_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """--part wins; then the array; torchrun inside an array task is ambiguous: refused."""
    for name, value in array(2, 1, 2).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert choose_part((0, 4)) == ((0, 4), "--part")
    assert choose_part(None)[0] == (1, 2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"both torchrun .* and a Slurm array"):
        choose_part(None)
