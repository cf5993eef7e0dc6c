"""
Code size of each script in code tokens: every Python token except comments, newlines and indentation, with each
docstring one token whatever its length (the module's none), so that neither comments, docstrings nor packing code
onto fewer lines changes the count. This is issue 30's measure: it gives that issue's table for its commit 42d6ae7.

    python bench/code_size.py            # a table: lines, code tokens, lines over 120 characters

Below the table: the code tokens that train_gpt2.py and mid_train.py share outside their marked shared blocks (every
maximal run of 8 or more identical code tokens common to the two, greedily matched, summed; issue 54's measure,
as ../shared/tools/trainer_overlap.py counts it): copy that no sync tool keeps the same.
"""

import ast
import difflib
import io
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["train_gpt2.py", "mid_train.py", "hellaswag.py", "sample.py", "export_hf.py", "prepare_fineweb.py",
           "plot_runs.py"]
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
          tokenize.ENCODING}


def docstrings(source):
    """The first lines of the docstrings: a string standing alone as a module's, class's or def's first line."""
    return {node.body[0].lineno: isinstance(node, ast.Module) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)}


def tokens(source):
    docs = docstrings(source)
    return [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in LAYOUT
            and not (t.type == tokenize.STRING and docs.get(t.start[0]))]


def code_tokens(source):
    return len(tokens(source))


def unsynced_tokens(source):
    """The code tokens outside the `# ---- shared: NAME ----` blocks, as strings."""
    inside, skipped = False, set()
    for number, line in enumerate(source.splitlines(), 1):
        inside = inside or line.startswith("# ---- shared: ")
        if inside:
            skipped.add(number)
        inside = inside and not line.startswith("# ---- end shared: ")
    return [t.string for t in tokens(source) if t.start[0] not in skipped]


def trainers_overlap():
    """Code tokens common to the two trainers outside their shared blocks, in runs of at least 8."""
    a, b = (unsynced_tokens(open(os.path.join(ROOT, name)).read()) for name in ("train_gpt2.py", "mid_train.py"))
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    return sum(block.size for block in blocks if block.size >= 8)


if __name__ == "__main__":
    print(f"{'file':<20} {'lines':>6} {'code tokens':>12} {'lines > 120':>12}")
    for name in sys.argv[1:] or SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            source = f.read()
        lines = source.splitlines()
        print(f"{name:<20} {len(lines):>6,} {code_tokens(source):>12,} {sum(len(l) > 120 for l in lines):>12}")
    print(f"\ncode tokens common to train_gpt2.py and mid_train.py outside shared blocks: {trainers_overlap():,}")
