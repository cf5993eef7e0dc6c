import ast
import os
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tests"))
from sync_shared import SCRIPTS, differing_copies, read_blocks  # noqa: E402


def test_shared_blocks_are_identical():
    diffs = differing_copies()
    assert not diffs, f"copies differ from their canonical block (run python tests/sync_shared.py): {diffs}"


def test_every_script_is_importable_without_side_effects(tmp_path):
    for script in SCRIPTS:
        path = os.path.join(REPO, script)
        if not os.path.exists(path):
            continue
        tree = ast.parse(open(path).read())
        last = tree.body[-1]
        assert isinstance(last, ast.If) and "__main__" in ast.unparse(last.test), f"{script} must end in a __main__ guard"
        # importing it runs nothing and writes nothing
        proc = subprocess.run([sys.executable, "-c", f"import {script[:-3]}"], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": REPO})
        assert proc.returncode == 0 and proc.stdout == "", (script, proc.stdout, proc.stderr)
    assert os.listdir(tmp_path) == []


def test_every_flag_has_help():
    for script in SCRIPTS:
        path = os.path.join(REPO, script)
        if not os.path.exists(path):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                assert any(k.arg == "help" for k in node.keywords), f"{script}: {ast.unparse(node)} has no help"


def test_shared_blocks_exist_where_expected():
    assert {"model", "loss", "tokenizer", "checkpoint", "distributed"} <= set(read_blocks(os.path.join(REPO, "train_gpt2.py")))


def test_help_shows_defaults(capsys, monkeypatch):
    import importlib
    import pytest
    monkeypatch.setenv("COLUMNS", "250")  # one line per flag: a default is not split across lines
    expected = {"train_gpt2": ["peak learning rate (AdamW) (default: 0.0006)", "(default: data/fineweb-edu-10BT)"],
                "mid_train": ["(default: 0.0002)", "(default: out/mid)"],
                "sample": ["(default: 256)", "(default: float32)"],
                "hellaswag": ["(default: 16)", "(default: float32)"],
                "prepare_fineweb": ["(default: 100000000)", f"tokenizer processes, one a core (default: {os.cpu_count()})\n"]}
    for script, shown in expected.items():
        with pytest.raises(SystemExit):
            importlib.import_module(script).get_args(["--help"])
        text = capsys.readouterr().out
        assert all(s in text for s in shown), (script, text)


def test_inference_defaults_are_float32_weights():
    import hellaswag
    import sample
    assert hellaswag.get_args(["--ckpt", "x"]).dtype == sample.get_args(["--ckpt", "x"]).dtype == "float32"
    assert not hellaswag.get_args(["--ckpt", "x"]).cast_weights
