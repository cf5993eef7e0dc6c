"""tools/: the sync tool's --help, the shared blocks' contracts it checks, and check_edit.py, each run as a researcher
would on a copy of the repo."""

import os
import re
import shutil
import subprocess
import sys

from conftest import REPO
from sync_shared import SCRIPTS, read_blocks
from test_shared import copy_of_repo, run_sync


def edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_help_prints_usage_and_syncs_nothing(tmp_path):
    root = copy_of_repo(tmp_path)
    edit(root / "mid_train.py", "# ---- end shared: model ----", "# a pending edit\n# ---- end shared: model ----")
    files = SCRIPTS + ["tools/shared_blocks.json"]
    before = {name: (root / name).read_bytes() for name in files}
    proc = run_sync(root, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: sync_shared.py") and "--check" in proc.stdout
    proc = run_sync(root, "--chek")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unrecognized arguments: --chek"), proc.stderr
    assert {name: (root / name).read_bytes() for name in files} == before


def test_a_flag_read_in_a_shared_block_must_be_a_flag_of_every_script_holding_it(tmp_path):
    root = copy_of_repo(tmp_path)
    # the flag in train_gpt2.py's own flags, read in the optim block that mid_train.py holds too
    edit(root / "train_gpt2.py", '    # schedule\n',
         '    add("--embedding_lr_scale", type=float, default=10.0, help="the embedding\'s lr over --lr")\n'
         '    # schedule\n')
    edit(root / "train_gpt2.py", '    fused = device_type in ("cuda", "cpu")',
         '    groups[0]["lr"] = args.lr * args.embedding_lr_scale\n    fused = device_type in ("cuda", "cpu")')
    proc = run_sync(root)
    assert proc.returncode == 1 and "synced mid_train.py" in proc.stdout
    # mid_train.py alone lacks it
    assert proc.stderr.startswith("mid_train.py: shared block 'optim' reads args.embedding_lr_scale"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert run_sync(root, "--check").stdout == proc.stderr


def test_a_call_that_no_longer_fits_a_shared_function_is_named(tmp_path):
    root = copy_of_repo(tmp_path)
    # evaluate_val_loss returns a third value; train_gpt2.py's call takes it, mid_train.py's does not
    edit(root / "train_gpt2.py", "    return loss_sum / count, text_nats / (math.log(2) * text_bytes)\n",
         "    return loss_sum / count, text_nats / (math.log(2) * text_bytes), count\n")
    edit(root / "train_gpt2.py", "val_loss, val_bpb = evaluate_val_loss(", "val_loss, val_bpb, _ = evaluate_val_loss(")
    # and a keyword that its signature does not take
    edit(root / "mid_train.py", "def load_checkpoint(path, mmap=False):", "def load_checkpoint(path, map=False):")
    proc = run_sync(root)
    assert proc.returncode == 1 and "synced mid_train.py" in proc.stdout
    line = next(n for n, text in enumerate((root / "mid_train.py").read_text().splitlines(), 1)
                if "= evaluate_val_loss(" in text)
    assert (f"mid_train.py:{line}: evaluate_val_loss(...), from shared block 'val', is unpacked into 2 values; "
            f"it returns 3") in proc.stderr.splitlines(), proc.stderr
    assert re.search(r"^\w+.py:\d+: load_checkpoint\(...\), from shared block 'checkpoint', passes mmap=, "
                     r"which it does not take$", proc.stderr, re.M), proc.stderr


def check_edit(root):
    return subprocess.run([sys.executable, str(root / "tools" / "check_edit.py")], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)


def test_check_edit_passes_the_tree_and_names_the_script_an_edit_breaks(tmp_path):
    root = copy_of_repo(tmp_path)
    shutil.copy(os.path.join(REPO, "tools", "check_edit.py"), root / "tools")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "the repo"]):
        subprocess.run(git + command, cwd=root, check=True)
    proc = check_edit(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"{script}: ok" in proc.stdout.splitlines() for script in SCRIPTS), proc.stdout
    # the edit of the test above: synced, mid_train.py's call site unpacks two values
    edit(root / "train_gpt2.py", "    return loss_sum / count, text_nats / (math.log(2) * text_bytes)\n",
         "    return loss_sum / count, text_nats / (math.log(2) * text_bytes), count\n")
    edit(root / "train_gpt2.py", "val_loss, val_bpb = evaluate_val_loss(", "val_loss, val_bpb, _ = evaluate_val_loss(")
    assert run_sync(root).returncode == 1
    proc = check_edit(root)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    # only the two scripts holding the changed block ran
    assert "train_gpt2.py: ok" in lines and not any(line.startswith("sample.py") for line in lines), proc.stdout
    assert re.search(r"^mid_train.py: failed at midtrain, exit 1 \(mid_train.py:\d+\): ValueError: too many values "
                     r"to unpack \(expected 2", proc.stdout, re.M), proc.stdout
    # it worked in a temp folder
    assert sorted(os.listdir(root / "tools")) == ["check_edit.py", "shared_blocks.json", "sync_shared.py"]
    assert not set(os.listdir(root)) - {".git", "tools", *SCRIPTS}
    assert read_blocks(root / "mid_train.py")["val"] == read_blocks(root / "train_gpt2.py")["val"]
