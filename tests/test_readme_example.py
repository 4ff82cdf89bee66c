"""The training example in README.md runs as written, and trains as one process does.

The first ```python block under "## Train a model on many devices" is written to a file and run
as a script (``python train.py``: it forks 2 gloo ranks); its printed losses are compared with
the same model trained on the same batches in this process by a plain PyTorch loop.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Train a model on many devices"


def readme_example() -> str:
    """The source of the first python code block of the README's training section."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    match = re.search(r"```python\n(.*?)```", text.split(SECTION, 1)[1], re.S)
    assert match, f"README.md's section {SECTION!r} has no ```python block"
    return match.group(1)


def single_process_losses(source: str) -> list:
    """The example's model and batches (its own functions), trained by a plain loop."""
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(source, "README.md", "exec"), namespace)
    model, batches = namespace["build_model"](), namespace["batches"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_readme_training_example_runs_as_written(tmp_path):
    source = readme_example()
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"the README example failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    printed = [line for line in run.stdout.splitlines() if line.startswith("losses ")]
    assert len(printed) == 1, f"the README example printed no 'losses [...]' line:\n{run.stdout[-3000:]}"
    losses = ast.literal_eval(printed[0].removeprefix("losses "))
    assert "Sharding plan for LlamaForCausalLM" in run.stdout
    torch.testing.assert_close(losses, single_process_losses(source))
