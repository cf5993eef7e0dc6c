import ast
import os
import shutil
import subprocess
import sys

from conftest import REPO

from sync_shared import SCRIPTS, contract_problems, differing_copies, read_blocks, stale_record


def test_shared_blocks_are_identical():
    diffs = differing_copies()
    assert not diffs, f"copies of a shared block differ (run python tools/sync_shared.py): {diffs}"
    stale = stale_record()
    assert not stale, f"tools/shared_blocks.json is out of date for {stale} (run python tools/sync_shared.py)"
    problems = contract_problems()
    assert not problems, "\n".join(problems)


def copy_of_repo(tmp_path):
    """The scripts, the sync tool and its record, copied where the tool can rewrite them."""
    (tmp_path / "tools").mkdir()
    for name in SCRIPTS + ["tools/sync_shared.py", "tools/shared_blocks.json"]:
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    return tmp_path


def edit_block(path, name, line):
    """Add a line at the end of the script's copy of a shared block."""
    end = f"# ---- end shared: {name} ----"
    path.write_text(path.read_text().replace(end, f"{line}\n{end}"))


def run_sync(root, *flags):
    return subprocess.run([sys.executable, str(root / "tools" / "sync_shared.py"), *flags], capture_output=True,
                          text=True)


def test_an_edit_in_any_copy_reaches_every_other(tmp_path):
    root = copy_of_repo(tmp_path)
    edit_block(root / "mid_train.py", "model", "# edited in mid_train.py")
    proc = run_sync(root)
    assert proc.returncode == 0, proc.stderr
    for script in SCRIPTS:
        blocks = read_blocks(root / script)
        assert "model" not in blocks or blocks["model"].endswith("# edited in mid_train.py\n"), script
    assert run_sync(root, "--check").returncode == 0


def test_two_different_edits_are_refused_and_both_kept(tmp_path):
    root = copy_of_repo(tmp_path)
    edit_block(root / "mid_train.py", "model", "# edited in mid_train.py")
    edit_block(root / "sample.py", "model", "# edited in sample.py")
    # a clean edit of another block is held back too: a refused sync changes no file at all
    edit_block(root / "hellaswag.py", "tokenizer", "# edited in hellaswag.py")
    files = SCRIPTS + ["tools/shared_blocks.json"]
    before = {name: (root / name).read_bytes() for name in files}
    proc = run_sync(root)
    assert proc.returncode == 1 and "mid_train.py" in proc.stderr and "sample.py" in proc.stderr, proc.stderr
    assert {name: (root / name).read_bytes() for name in files} == before


def test_a_copy_put_back_to_an_earlier_version_does_not_undo_the_edit(tmp_path):
    """Edit, sync, then one script is put back as it was (a git checkout of it): the next sync refuses, naming it,
    instead of copying the old block over the edit."""
    root = copy_of_repo(tmp_path)
    unedited = (root / "sample.py").read_bytes()
    edit_block(root / "mid_train.py", "model", "# edited in mid_train.py")
    assert run_sync(root).returncode == 0
    (root / "sample.py").write_bytes(unedited)
    files = SCRIPTS + ["tools/shared_blocks.json"]
    before = {name: (root / name).read_bytes() for name in files}
    proc = run_sync(root)
    assert proc.returncode == 1 and "sample.py is a version synced before" in proc.stderr, proc.stderr
    assert {name: (root / name).read_bytes() for name in files} == before
    assert read_blocks(root / "train_gpt2.py")["model"].endswith("# edited in mid_train.py\n")
    # every copy put back by hand: a wanted return to the earlier version, which syncs
    unedited_blocks = read_blocks(root / "sample.py")
    for script in SCRIPTS:
        text = (root / script).read_text() if (root / script).exists() else ""
        if "# edited in mid_train.py\n" in text:
            (root / script).write_text(text.replace("# edited in mid_train.py\n", ""))
    assert run_sync(root).returncode == 0
    assert read_blocks(root / "train_gpt2.py")["model"] == unedited_blocks["model"]


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
    assert {"model", "step", "tokenizer", "checkpoint", "distributed"} <= set(read_blocks(os.path.join(REPO, "train_gpt2.py")))


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
