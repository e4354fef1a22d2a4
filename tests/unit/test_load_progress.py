"""Weight-load progress: a bar only on a terminal; a log file or the journal gets a few plain lines, not
one carriage-return frame per tensor."""

from __future__ import annotations

import io
import logging

import torch
from safetensors.torch import save_file

from crane_mp.worker.weights.load_progress import LoadProgress
from crane_mp.worker.weights.loader import iter_safetensors


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_load_logs_a_few_plain_lines(tmp_path, monkeypatch, caplog):
    save_file({f"w{i}": torch.zeros(2) for i in range(50)}, tmp_path / "model.safetensors")
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with caplog.at_level(logging.INFO, logger="crane_mp.worker.weights.load_progress"):
        names = [name for name, _ in iter_safetensors([tmp_path / "model.safetensors"], progress=True)]
    assert len(names) == 50
    assert "\r" not in stderr.getvalue()
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 4 and all("\r" not in line and "\n" not in line for line in lines)
    assert lines[-1] == "loading weights: 50 of 50 tensors (100%)"


def test_on_a_terminal_a_bar_is_drawn(monkeypatch, caplog):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with caplog.at_level(logging.INFO, logger="crane_mp.worker.weights.load_progress"):
        with LoadProgress(8, "GGUF weights") as bar:
            for _ in range(8):
                bar.update()
    assert "Loading GGUF weights" in terminal.getvalue() and "\r" in terminal.getvalue()
    assert not caplog.records


def test_disabled_progress_writes_nothing(monkeypatch, caplog):
    stderr = _Terminal()
    monkeypatch.setattr("sys.stderr", stderr)
    with caplog.at_level(logging.INFO, logger="crane_mp.worker.weights.load_progress"):
        with LoadProgress(8, "weights", enabled=False) as bar:
            bar.update(8)
    assert stderr.getvalue() == "" and not caplog.records
