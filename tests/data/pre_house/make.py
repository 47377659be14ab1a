"""How this folder was made, in a checkout of 2892e50 (the commit before the house moved):

    python tests/data/pre_house/make.py /tmp/pre_house

A 2-rank run of the tiny model to step 6 (``run/``, as written) and one to step 12, whose
weights and per-rank RNG and loader states are ``step-12/``. ``tests/test_layers.py`` resumes
``run/`` with today's code and compares. Needs the cache the test suite builds (``TRAIN_CACHE_TOML``).
"""

import subprocess
import sys
from pathlib import Path

repo = Path.cwd()
sys.path.insert(0, str(repo / "tests"))
import helpers  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "short.toml").write_text(helpers.TRAIN_CACHE_TOML)
cache = helpers.build_cache(out / "cache", out / "short.toml")
extra = ("train.ckpt_every=6", "train.log_every=3")
for name, steps in (("straight", 12), ("resumed", 6)):
    cmd = helpers.train_cmd(cache, out / name, *extra, max_steps=steps)
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
# Then: resumed/{checkpoints,config.json,metrics.jsonl} -> run/, and from straight's step 12
# shared.pt's model and ema -> step-12/weights.pt, each rank file's rng and loader ->
# step-12/rank-0000R.pt.
