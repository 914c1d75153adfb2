"""The power benchmark's sample parsing and per-block summary (`benchmarks.power`) on the CPU. The sampling and
timing need a GPU and nvidia-smi."""

import math
import os
import statistics
import sys
import time
from datetime import datetime

import pytest

from benchmarks import power
from benchmarks.power import block_means, parse_samples, summarize, table


def _stamp(text):
    return datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def test_samples_parse_and_bad_lines_are_skipped():
    lines = ["2026/12/03 17:40:01.020, 1410, 692.31", "", "2026/12/03 17:40:01.040, [N/A], 690.00",
             "garbage", "2026/12/03 17:40:01.060, 1980, 91.5"]
    samples = parse_samples(lines)
    assert samples == [(_stamp("2026/12/03 17:40:01.020"), 1410.0, 692.31),
                       (_stamp("2026/12/03 17:40:01.060"), 1980.0, 91.5)]


def test_a_block_averages_only_its_middle():
    # one sample per 0.1 s over a 1 s block: the first 20% (a clock settling after the previous block) and the
    # last 5% are left out
    samples = [(0.1 * i, 1000.0 + i, 600.0 + 10 * i) for i in range(11)]
    mhz, watts, used = block_means(0.0, 1.0, samples)
    assert used == 8  # t = 0.2 .. 0.9
    assert mhz == pytest.approx(statistics.mean(range(1002, 1010)))
    assert watts == pytest.approx(statistics.mean(range(620, 700, 10)))
    assert all(math.isnan(v) for v in block_means(5.0, 5.01, samples)[:2])


def test_summary_takes_medians_per_side_and_energy_from_power_and_time():
    samples = [(0.05 * i, 1400.0 if i < 40 else 1800.0, 690.0) for i in range(80)]
    blocks = [("hf+comp", 0.0, 1.0, 1.2), ("mok", 2.0, 3.0, 0.8), ("mok", 2.0, 3.0, 0.9), ("hf+comp", 0.0, 1.0, 1.0)]
    s = summarize(blocks, samples)
    assert s["hf+comp"]["ms"] == pytest.approx(1.1) and s["mok"]["ms"] == pytest.approx(0.85)
    assert s["hf+comp"]["mhz"] == 1400.0 and s["mok"]["mhz"] == 1800.0
    assert s["mok"]["joules"] == pytest.approx(690.0 * 0.85 / 1000)
    assert s["mok"]["blocks"] == 2
    row = {"shape": "qwen3", "T": 4096, "phase": "fwd", "floor_ms": 0.425, "sides": s}
    text = table([row])
    assert "| qwen3 | 4096 | fwd | mok | 0.850 | 1800 | 690 | 0.587 | 1.29 | 1.29 | 0.50 |" in text
    assert "| qwen3 | 4096 | fwd | hf+comp | 1.100 | 1400 | 690 | 0.759 | 1.00 | 1.00 | 0.39 |" in text


class _HostEvent:
    """A stand-in for torch.cuda.Event on the CPU: the host clock at record()."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000


FAKE_SMI = '''#!{python}
import datetime, sys, time
if "-lms" not in sys.argv:  # the power field probe
    print("{instant}")
    sys.exit(0)
while True:
    print(datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3] + ", 1500, 690.00", flush=True)
    time.sleep(0.02)
'''


def test_blocks_get_the_samples_taken_while_they_ran(tmp_path, monkeypatch):
    """The sampling plumbing, with a stand-in nvidia-smi (one line per 20 ms) and host-clock events: every block
    gets samples, and a side's ms per call is its calls' time."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable, instant="689.50"))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(power.torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(power.torch.cuda, "synchronize", lambda: None)
    fns = {"slow": lambda: time.sleep(0.004), "fast": lambda: time.sleep(0.002)}
    blocks, samples = power.run_blocks(fns, seconds=0.25, rounds=2)
    assert [side for side, *_ in blocks] == ["slow", "fast", "fast", "slow"]
    s = power.summarize(blocks, samples)
    assert s["slow"]["ms"] > s["fast"]["ms"] >= 2.0
    for side in fns:
        assert s[side]["blocks"] == 2 and s[side]["samples"] >= 4
        assert s[side]["mhz"] == 1500.0 and s[side]["watts"] == 690.0


@pytest.mark.parametrize("probe, field", [("689.50", "power.draw.instant"), ("[N/A]", "power.draw")])
def test_power_is_sampled_instantly_where_the_driver_can(tmp_path, monkeypatch, probe, field):
    """`power.draw` is a one-second mean on Ampere and later; the instant field is taken where nvidia-smi gives a
    number for it, and the near miss, a driver answering "[N/A]", falls back to `power.draw`."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable, instant=probe))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert power.power_field() == field
