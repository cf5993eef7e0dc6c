"""
Keep the copied code honest. Code that several scripts need sits between `# ---- shared: NAME ----` and
`# ---- end shared: NAME ----` markers. The canonical copy of a block is in the first of SCRIPTS that has it
(train_gpt2.py for nearly all); this tool copies it over every other script's block of the same name.

    python tests/sync_shared.py           # rewrite the copies from the canonical blocks
    python tests/sync_shared.py --check   # list copies that differ, exit 1 if any (tests/test_shared.py)
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["train_gpt2.py", "mid_train.py", "sample.py", "hellaswag.py", "prepare_fineweb.py", "export_hf.py"]
BLOCK = re.compile(r"^# ---- shared: (\w+) ----\n(.*?)^# ---- end shared: \1 ----$", re.S | re.M)


def read_blocks(path):
    with open(path) as f:
        return {m.group(1): m.group(2) for m in BLOCK.finditer(f.read())}


def canonical_blocks():
    canonical = {}
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        if os.path.exists(path):
            for name, body in read_blocks(path).items():
                canonical.setdefault(name, (script, body))
    return canonical


def differing_copies():
    """(script, block, canonical script) for every copy that is not identical to its canonical block."""
    canonical = canonical_blocks()
    diffs = []
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        if os.path.exists(path):
            for name, body in read_blocks(path).items():
                if body != canonical[name][1]:
                    diffs.append((script, name, canonical[name][0]))
    return diffs


def sync():
    canonical = canonical_blocks()
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        synced = BLOCK.sub(lambda m: f"# ---- shared: {m.group(1)} ----\n{canonical[m.group(1)][1]}"
                                     f"# ---- end shared: {m.group(1)} ----", text)
        if synced != text:
            with open(path, "w") as f:
                f.write(synced)
            print(f"synced {script}")


if __name__ == "__main__":
    if "--check" in sys.argv:
        diffs = differing_copies()
        for script, name, source in diffs:
            print(f"{script}: shared block '{name}' differs from {source}; run python tests/sync_shared.py")
        sys.exit(1 if diffs else 0)
    sync()
