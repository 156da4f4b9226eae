"""Issue 19: every CLI direction writes byte-identical files to what main 6271fa1 wrote.

The fixture (tests/fixtures/golden_6271fa1.json) holds the sha256 of every file each direction of
tests/golden_outputs.py wrote at 6271fa1 (how it was recorded and what is normalised: that module's docstring).
Here the same directions run with the current code from the same tiny source; one test per direction compares
the set of files and each file's hash.
"""
import json
import os
import shlex

import pytest

from golden_outputs import DIRECTIONS, run_all, versions

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "golden_6271fa1.json")
with open(FIXTURE) as _f:
    GOLD = json.load(_f)

# Differences from 6271fa1 that main made on purpose before issue 19, each pinned to its exact new bytes (so the
# refactor may change neither). Delete an entry to require 6271fa1's bytes again.
CHANGED_SINCE_6271FA1 = {
    # 81c2b01 (issue 18a) writes common.pt with fsutil.write_file(_save_bytes({})) instead of
    # torch.save({}, path), so that a full disk is an OSError (ENOSPC, exit 3) rather than torch's
    # "RuntimeError: ... iostream error". torch.save names the zip's top folder after the file's stem when given
    # a path ("common/data.pkl", what megatron-core's TorchCommonSaveStrategy writes too) and "archive" when
    # given a buffer ("archive/data.pkl"): 1261 bytes instead of 1255, same records and content; torch.load
    # (megatron's load_common) reads either and returns {}.
    "common.pt": {"6271fa1": "ee4105d37fc638d305664f922587c32a92684dd1b9826a6ad193b7b0b3e547ee",
                  "now": "07c7431cf6005e7d8f367d79e995f63e2f9b981a37e3437b795d058f9af4308b"},
}


# Directions whose 6271fa1 output was wrong and is fixed on purpose: each pinned to its exact new files and bytes
# (the fixture says why).
with open(os.path.join(os.path.dirname(__file__), "fixtures", "golden_fixed_since_6271fa1.json")) as _f:
    FIXED = json.load(_f)


def _env_note():
    now = {k: v for k, v in versions().items() if k != "python"}
    was = {k: v for k, v in GOLD["versions"].items() if k != "python"}
    return "" if now == was else f" (environment changed: fixture recorded with {was}, now {now})"


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return run_all(str(tmp_path_factory.mktemp("golden")))


def test_directions_are_the_recorded_ones():
    assert {n: shlex.join(a) for n, a in DIRECTIONS} == GOLD["argv"]


def test_source_is_the_recorded_one(current):
    """The tiny source (current synth, same seed) is the one the fixture was recorded from; if not, the
    environment changed (torch / transformers / safetensors), not ckpt-tools."""
    assert current["source"] == GOLD["source"], "source differs" + _env_note()


@pytest.mark.parametrize("name", sorted(GOLD["directions"]))
def test_output_bytes_equal_6271fa1(current, name):
    assert current["rc"][name] == 0, current["output"][name][-3000:]
    assert current["source"] == GOLD["source"], "source differs (see test_source_is_the_recorded_one)"
    got, want = current["directions"][name], FIXED["directions"].get(name, GOLD["directions"][name])
    problems = [f"{f}: missing (6271fa1 wrote it)" for f in sorted(set(want) - set(got))]
    problems += [f"{f}: new file (6271fa1 did not write it)" for f in sorted(set(got) - set(want))]
    for f in sorted(set(got) & set(want)):
        known = CHANGED_SINCE_6271FA1.get(os.path.basename(f))
        if got[f] != want[f] and not (known and want[f] == known["6271fa1"] and got[f] == known["now"]):
            problems.append(f"{f}: sha256 {got[f]} != {want[f]}")
    assert not problems, f"{name}: " + "; ".join(problems) + _env_note()
