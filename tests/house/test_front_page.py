"""The front page's headline numbers equal docs/results.md's: each figure of a row of the
README's "Headline numbers" table appears in the section its row links to (as written, or
rounded to the figure's decimals), so a rerun benchmark cannot leave the front page stale."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Figures a row states that no benchmark measures: arithmetic on the format's constants.
NOT_MEASURED = {
    "shards per hour of audio": {"16", "24", "172.8"},  # 16-bit 24 kHz PCM: 2 × 24,000 × 3,600 B
}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """Each heading's anchor → its text, down to the next heading."""
    out, name = {}, ""
    for line in text.splitlines():
        if line.startswith("#"):
            name = slug(line.lstrip("#"))
        out[name] = out.get(name, "") + line + "\n"
    return out


def numbers(text: str) -> set[str]:
    """Every number in ``text``, thousands separators dropped."""
    return {n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


def found(figure: str, measured: set[str]) -> bool:
    """Whether ``figure`` is one of ``measured``, as written or rounded to its decimals."""
    places = Decimal(figure).as_tuple().exponent
    return any(Decimal(m).quantize(Decimal(1).scaleb(places)) == Decimal(figure) for m in measured)


def headline_rows() -> list[tuple[str, str, str, str]]:
    """(what, figure, linked file, anchor) of each row of the README's headline table."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        link = re.search(r"\]\(([^)#]+)#([^)]+)\)", cells[-1]) if len(cells) == 3 else None
        if link:
            rows.append((cells[0], cells[1], link[1], link[2]))
    return rows


def test_the_headline_table_is_read() -> None:
    assert len(headline_rows()) >= 8, headline_rows()


@pytest.mark.parametrize(("what", "figure", "page", "anchor"), headline_rows())
def test_a_headline_figure_is_the_measured_one(
    what: str, figure: str, page: str, anchor: str
) -> None:
    section = sections((REPO / page).read_text(encoding="utf-8")).get(anchor)
    assert section is not None, f"{what}: {page} has no section #{anchor}"
    measured = numbers(section)
    wanted = numbers(what) | NOT_MEASURED.get(what, set())  # "8 / 64 / 512 ranks" and such
    stale = [n for n in sorted(numbers(figure)) if n not in wanted and not found(n, measured)]
    assert not stale, f"README's {what!r}: {stale} not in {page}#{anchor}"


def test_a_stale_figure_is_caught() -> None:
    """The check itself: a figure off by one in its last digit is not found."""
    assert found("16.9", {"16.904"}) and found("9682", {"9682"})
    assert not found("16.8", {"16.904"}) and not found("9683", {"9682"})
