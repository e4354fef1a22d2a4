"""llama.cpp's convert_hf_to_gguf.py as the peers installed it (../shared/peers), started once and
forked for each conversion: its start (torch, transformers, its table of models) takes 2-3 s, which
every one of the GGUF families' thirty-odd conversions paid before."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

LLAMA_CPP = Path(os.environ.get("PEERS", Path.home() / "peers")) / "llama"
CONVERTER = LLAMA_CPP / "src/vendor/llama.cpp/convert_hf_to_gguf.py"
CONVERTER_PYTHON = LLAMA_CPP.parent / "venv-conv/bin/python"

# Reads one job a line ({"args": [...], "log": path}); a forked child runs the converter's main() on
# the job's arguments with its output in the log, and the parent answers the child's exit code.
_DRIVER = r"""
import importlib.util, json, os, sys, traceback
path = sys.argv[1]
sys.path.insert(0, os.path.dirname(path))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", path)
module = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = module
spec.loader.exec_module(module)
answers = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.argv = [path, *job["args"]]
        code = 0
        try:
            module.main()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    answers.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")
    answers.flush()
"""


class Converter:
    """convert(source_dir, outtype, outfile): one conversion, raising with the converter's output when
    it fails. Byte-level BPE vocabularies are read with Qwen2's split rule (GGUF_FORCE_PRE: the test
    tokenizers' hash is in no table of the converter's). close() when done."""

    def __init__(self) -> None:
        self._process = subprocess.Popen([str(CONVERTER_PYTHON), "-c", _DRIVER, str(CONVERTER)], cwd=CONVERTER.parent,
                                         env={**os.environ, "GGUF_FORCE_PRE": "qwen2"}, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def __call__(self, source: Path, outtype: str, outfile: Path, *options: str) -> Path:
        log = outfile.with_suffix(".convert.log")
        job = {"args": [str(source), "--outtype", outtype, "--outfile", str(outfile), *options], "log": str(log)}
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"llama.cpp's converter stopped (exit {self._process.wait()})")
        code = json.loads(answer)
        if code != 0:
            raise RuntimeError(f"llama.cpp's converter failed on {source} (exit {code}):\n{log.read_text()[-3000:]}")
        return outfile

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=60)
