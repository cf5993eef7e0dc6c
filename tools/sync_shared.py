"""
Keep the copied code honest. Code that several scripts need sits between `# ---- shared: NAME ----` and
`# ---- end shared: NAME ----` markers, one copy in each script that needs it. Edit any copy, then run this tool:
it copies the edited block over the others. tools/shared_blocks.json holds a hash of each block as last synced, so a
copy whose hash differs from it is one that was edited. When copies of a block were edited differently, the tool
changes no file, names them, and exits 1: make them the same by hand, then run it again. The record also keeps the
hashes of earlier synced versions, so that a copy put back to one of them (a `git checkout` of one script, a file
copied in from upstream) is refused too, rather than taken for a new edit and copied over the newer block.

A block is a contract with every script that holds it, checked after each sync and by --check (exit 1 if broken):
- each flag the block reads (`args.NAME`) is defined in every script holding it: put a new flag in a shared flags
  block, or in the flags of each script that holds the block;
- each call, in those scripts, of a function the block defines fits its signature, and unpacks as many values as
  the function returns.

    python tools/sync_shared.py           # copy each edited block over its other copies, update the record, check
    python tools/sync_shared.py --check   # list copies that differ, a stale record and broken contracts
"""

import argparse
import ast
import hashlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tools", "shared_blocks.json")
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
                             f"tools/sync_shared.py")
        elif len(set(edited.values())) > 1:
            conflicts.append(f"error: shared block '{name}' was edited differently in {' and '.join(edited)}; "
                             f"make them the same by hand, then run python tools/sync_shared.py")
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
        print("updated tools/shared_blocks.json")
    return []

# -----------------------------------------------------------------------------
# the contract of a block with the scripts that hold it, read from their syntax trees


def block_nodes(text, tree):
    """{block: the top-level statements between its markers} of a script."""
    starts = {m.group(1): (text.count("\n", 0, m.start()) + 1, text.count("\n", 0, m.end()) + 1)
              for m in BLOCK.finditer(text)}
    return {name: [node for node in tree.body if first < node.lineno < last] for name, (first, last) in starts.items()}


def is_args(node):
    return isinstance(node, ast.Name) and node.id == "args"


def spelled_names(tree):
    """The fields of a script's dataclasses: the flags a loop adds by name (train_gpt2.py's, one a GPTConfig field)."""
    return {node.target.id for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def defined_flags(tree):
    """The names a script's args can hold: its flags (add_argument's --NAME or dest, also called by another name,
    set_defaults' keywords), and what its code sets on args (`args.NAME = ...`, setattr(args, "NAME", ...)). A flag
    named at run time (f"--{name}", as each GPTConfig field is) may be any field of its dataclasses (spelled_names)."""
    names = set()
    # add_argument, and the names it is given to be called by (`add = p.add_argument`)
    adders = {"add_argument"} | {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                                 and getattr(node.value, "attr", None) == "add_argument"
                                 for target in node.targets if isinstance(target, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and is_args(node.value):
            names.add(node.attr)
        if not isinstance(node, ast.Call):
            continue
        method = getattr(node.func, "attr", getattr(node.func, "id", ""))
        literals = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if method in adders:
            names |= {a.removeprefix("--").replace("-", "_") for a in literals if a.startswith("--")}
            names |= {k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)}
            if node.args and not isinstance(node.args[0], ast.Constant):  # named at run time
                names |= spelled_names(tree)
        elif method == "set_defaults":
            names |= {k.arg for k in node.keywords if k.arg}
        elif method == "setattr" and node.args and is_args(node.args[0]) and literals:
            names.add(literals[0])
    return names


def flags_read(nodes):
    """{NAME: line} of each args.NAME the statements read."""
    return {node.attr: node.lineno for top in nodes for node in ast.walk(top) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load) and is_args(node.value)}


def returned_count(function):
    """How many values a function returns, where every return gives a tuple of one length; else None."""
    counts = set()
    for node in ast.walk(function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not function:
            return None  # a nested def's returns are not this one's (kept simple: no count)
        if isinstance(node, ast.Return):
            tuple_ = isinstance(node.value, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in node.value.elts)
            counts.add(len(node.value.elts) if tuple_ else None)
    return counts.pop() if len(counts) == 1 else None


def call_misfits(call, function):
    """What in a call its function's signature does not take: a list of short phrases."""
    params = function.args
    positional = [a.arg for a in params.posonlyargs + params.args]
    if function.name == "__init__":  # called by its class's name, without self
        positional = positional[1:]
    misfits = []
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return misfits  # *args or **kwargs at the call: not counted
    if len(call.args) > len(positional) and not params.vararg:
        misfits.append(f"passes {len(call.args)} positional arguments; it takes {len(positional)}")
    named = positional + [a.arg for a in params.kwonlyargs]
    misfits += [f"passes {k.arg}=, which it does not take" for k in call.keywords
                if k.arg not in named and not params.kwarg]
    required = positional[:len(positional) - len(params.defaults)]
    required += [a.arg for a, default in zip(params.kwonlyargs, params.kw_defaults) if default is None]
    given = set(positional[:len(call.args)]) | {k.arg for k in call.keywords}
    misfits += [f"does not pass {name}" for name in required if name not in given]
    return misfits


def named_calls(tree):
    """(the assignment, the call) of each call of a name that is assigned, (the call, the call) of the others."""
    pairs, assigned = [], set()
    for node in ast.walk(tree):  # a statement before what it holds
        call = node.value if isinstance(node, ast.Assign) else node
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and id(call) not in assigned:
            pairs.append((node, call))
            assigned.add(id(call))
    return pairs


def functions_of(nodes):
    """{name: def} of the functions a block defines, and of its classes' __init__ (called by the class's name)."""
    functions = {node.name: node for node in nodes if isinstance(node, ast.FunctionDef)}
    for cls in (node for node in nodes if isinstance(node, ast.ClassDef)):
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init:
            functions[cls.name] = init
    return functions


def contract_problems():
    """One line for each flag a shared block reads that a script holding it lacks, and for each call, in a script
    holding a block, of the block's function that no longer fits it."""
    texts = {}
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        if os.path.exists(path):
            with open(path) as f:
                texts[script] = f.read()
    trees = {}
    for script, text in texts.items():
        try:
            trees[script] = ast.parse(text)
        except SyntaxError as e:
            return [f"{script}:{e.lineno}: a syntax error ({e.msg}): no contract checked"]
    blocks = {script: block_nodes(texts[script], tree) for script, tree in trees.items()}
    flags = {script: defined_flags(tree) for script, tree in trees.items()}
    calls = {script: named_calls(tree) for script, tree in trees.items()}
    problems = []
    for name in dict.fromkeys(name for script_blocks in blocks.values() for name in script_blocks):
        holders = [script for script in trees if name in blocks[script]]
        nodes = blocks[holders[0]][name]
        for flag, line in flags_read(nodes).items():
            lacking = [script for script in holders if flag not in flags[script]]
            problems += [f"{script}: shared block '{name}' reads args.{flag} (line {line} in {holders[0]}), which "
                         f"is no flag of {script}: define --{flag} in every script holding the block (a shared "
                         f"flags block), or read it outside the block" for script in lacking]
        functions = functions_of(nodes)
        for script in holders:
            for node, call in calls[script]:
                if call.func.id not in functions:
                    continue
                function = functions[call.func.id]
                where = f"{script}:{call.lineno}: {call.func.id}(...), from shared block '{name}',"
                problems += [f"{where} {misfit}" for misfit in call_misfits(call, function)]
                returned = returned_count(function)
                target = node.targets[0] if isinstance(node, ast.Assign) else None
                if returned and isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) != returned \
                        and not any(isinstance(e, ast.Starred) for e in target.elts):
                    problems.append(f"{where} is unpacked into {len(target.elts)} values; it returns {returned}")
    return problems


def refuse(message):
    """A bad argument: one line, exit 2, nothing done."""
    print(f"error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = refuse
    p.add_argument("--check", action="store_true",
                   help="change nothing: list copies that differ, a stale record and broken contracts; exit 1 if any")
    args = p.parse_args()
    if args.check:
        problems = [f"{script}: shared block '{name}' differs from {other}; run python tools/sync_shared.py"
                    for script, name, other in differing_copies()]
        problems += [f"tools/shared_blocks.json: the record of shared block '{name}' is out of date; "
                     f"run python tools/sync_shared.py" for name in stale_record()]
        problems += contract_problems()
        for problem in problems:
            print(problem)
        sys.exit(1 if problems else 0)
    problems = sync() or contract_problems()
    for problem in problems:
        print(problem, file=sys.stderr)
    sys.exit(1 if problems else 0)
