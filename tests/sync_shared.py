"""
Keep the copied code honest. Code that several scripts need sits between `# ---- shared: NAME ----` and
`# ---- end shared: NAME ----` markers, one copy in each script that needs it. Edit any copy, then run this tool:
it copies the edited block over the others. tests/shared_blocks.json holds a hash of each block as last synced, so a
copy whose hash differs from it is one that was edited. When copies of a block were edited differently, the tool
changes no file, names them, and exits 1: make them the same by hand, then run it again. The record also keeps the
hashes of earlier synced versions, so that a copy put back to one of them (a `git checkout` of one script, a file
copied in from upstream) is refused too, rather than taken for a new edit and copied over the newer block.

    python tests/sync_shared.py           # copy each edited block over its other copies, update the record
    python tests/sync_shared.py --check   # list copies that differ and a stale record; exit 1 if any
"""

import hashlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "shared_blocks.json")
SCRIPTS = ["train_gpt2.py", "mid_train.py", "sample.py", "hellaswag.py", "prepare_fineweb.py", "export_hf.py",
           "plot_runs.py"]
BLOCK = re.compile(r"^# ---- shared: (\w+) ----\n(.*?)^# ---- end shared: \1 ----$", re.S | re.M)


def read_blocks(path):
    with open(path) as f:
        return {m.group(1): m.group(2) for m in BLOCK.finditer(f.read())}


def digest(body):
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def all_copies():
    """{block: {script: body}} for every script that has the block, in the order of SCRIPTS."""
    copies = {}
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        if os.path.exists(path):
            for name, body in read_blocks(path).items():
                copies.setdefault(name, {})[script] = body
    return copies


def read_record():
    """{block: [hash as last synced, hashes of earlier synced versions...]}. Without a record every block is new: it
    is recorded where its copies agree and a conflict where they do not."""
    if not os.path.exists(RECORD):
        return {}
    with open(RECORD) as f:
        return json.load(f)


def synced_hash(record, name):
    return record.get(name, [None])[0]


def differing_copies():
    """(script, block, script) for every copy that is not identical to the block's first copy."""
    diffs = []
    for name, bodies in all_copies().items():
        first, body = next(iter(bodies.items()))
        diffs += [(script, name, first) for script, other in bodies.items() if other != body]
    return diffs


def stale_record():
    """Blocks whose copies agree but whose record does not (or that no script has): a later edit of one would look
    like a conflict."""
    copies, record = all_copies(), read_record()
    stale = [name for name, bodies in copies.items()
             if len(set(bodies.values())) == 1 and synced_hash(record, name) != digest(next(iter(bodies.values())))]
    return stale + [name for name in record if name not in copies]


def sync():
    """Copy each edited block over its other copies and update the record; return the conflicts instead, having
    changed nothing, when copies of a block were edited differently."""
    copies, record = all_copies(), read_record()
    synced, conflicts = {}, []
    for name, bodies in copies.items():
        # A copy unlike its record was edited since the last sync; every copy of a new block counts as edited. Edits
        # that all hold the same body are one edit, made in one copy or in several.
        edited = {script: body for script, body in bodies.items() if digest(body) != synced_hash(record, name)}
        earlier = [script for script, body in edited.items() if digest(body) in record.get(name, [])[1:]]
        # every copy put back to the same earlier version is a wanted return to it, made by hand in each
        if earlier and len(set(bodies.values())) > 1:
            conflicts.append(f"error: shared block '{name}' in {' and '.join(earlier)} is a version synced before "
                             f"(a script put back from git or upstream?), not a new edit; to go back to it, make "
                             f"every copy the same by hand, else copy the newer block into it, then run python "
                             f"tests/sync_shared.py")
        elif len(set(edited.values())) > 1:
            conflicts.append(f"error: shared block '{name}' was edited differently in {' and '.join(edited)}; "
                             f"make them the same by hand, then run python tests/sync_shared.py")
        synced[name] = next(iter(edited.values()), next(iter(bodies.values())))
    if conflicts:
        return conflicts
    # The scripts are written before the record: if this stops in between, the next run sees the same edit in
    # every copy, which syncs cleanly.
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        new = BLOCK.sub(lambda m: f"# ---- shared: {m.group(1)} ----\n{synced[m.group(1)]}"
                                  f"# ---- end shared: {m.group(1)} ----", text)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"synced {script}")
    # each block's hash as synced now, then the earlier ones (the last 50)
    new_record = {}
    for name, body in synced.items():
        earlier = [h for h in record.get(name, []) if h != digest(body)]
        new_record[name] = [digest(body), *earlier][:50]
    if new_record != record:
        with open(RECORD, "w") as f:
            f.write(json.dumps(new_record, indent=2) + "\n")
        print("updated tests/shared_blocks.json")
    return []


if __name__ == "__main__":
    if "--check" in sys.argv:
        problems = [f"{script}: shared block '{name}' differs from {other}; run python tests/sync_shared.py"
                    for script, name, other in differing_copies()]
        problems += [f"tests/shared_blocks.json: the record of shared block '{name}' is out of date; "
                     f"run python tests/sync_shared.py" for name in stale_record()]
        for problem in problems:
            print(problem)
        sys.exit(1 if problems else 0)
    conflicts = sync()
    for conflict in conflicts:
        print(conflict, file=sys.stderr)
    sys.exit(1 if conflicts else 0)
