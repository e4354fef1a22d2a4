"""Which processes may load torch: only the worker. The scheduler (and the shared protocol/config
modules) never imports torch or transformers; the frontend's and launcher's modules import neither,
and the launcher checks a model's layout without them. Each check runs in a fresh interpreter, where
sys.modules holds only what the code under test imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def imported_after(code: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` are in sys.modules once `code` has run in a new interpreter."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {names!r} if m in sys.modules))\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_scheduler_side_never_imports_torch():
    code = "import crane_mp.config, crane_mp.protocol, crane_mp.scheduler.scheduler, crane_mp.scheduler.process"
    assert imported_after(code, ("torch", "transformers", "numpy.linalg")) == []


def test_frontend_modules_import_neither_torch_nor_transformers():
    """Import time only: the tokenizer, once loaded (model_tokenizer.load_tokenizer), comes from
    transformers' AutoTokenizer, and transformers 5 imports torch there (configuration_utils ->
    modeling_rope_utils). The frontend process therefore still holds torch after start-up."""
    code = "import crane_mp.frontend.app, crane_mp.frontend.process"
    assert imported_after(code, ("torch", "transformers")) == []


def test_launcher_checks_a_model_without_torch(tmp_path: Path):
    # The launcher only checks the layout (config.json beside *.safetensors); the worker reads weights.
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").touch()
    code = (
        "import crane_mp.launch\n"
        "from crane_mp.cli import parse_args\n"
        f"parse_args(['--model-path', {str(tmp_path)!r}])\n"
    )
    assert imported_after(code, ("torch", "transformers")) == []
