"""
Code size of each script in code tokens: every Python token except comments, newlines and indentation, with each
docstring one token whatever its length (the module's none), so that neither comments, docstrings nor packing code
onto fewer lines changes the count.

    python bench/code_size.py            # a table: lines, code tokens, lines over 120 characters

For each trainer, also the code tokens above its banner: the `# ----...` line that follows main(), under which the
machinery that supports main() sits; above it are the flags, the model, the loader, the step and main(), the part
a reader reads first. Below the table: the code tokens that train_gpt2.py and mid_train.py share outside their
marked shared blocks (every maximal run of 8 or more identical code tokens common to the two, greedily matched,
summed): copy that no sync tool keeps the same.
"""

import argparse
import ast
import difflib
import io
import os
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


def banner_line(source):
    """The line number of the first `# ----...` banner after `def main(`, or None where there is none."""
    lines = source.splitlines()
    main = next((i for i, line in enumerate(lines) if line.startswith("def main(")), None)
    if main is None:
        return None
    return next((i + 1 for i in range(main, len(lines)) if lines[i].startswith("# ---------")), None)


def tokens_above_banner(source):
    """The code tokens above the banner after main(), or None where there is no such banner."""
    banner = banner_line(source)
    return None if banner is None else sum(t.start[0] < banner for t in tokens(source))


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=SCRIPTS, help="scripts to count (default: the seven)")
    files = parser.parse_args().files
    print(f"{'file':<20} {'lines':>6} {'code tokens':>12} {'above banner':>13} {'lines > 120':>12}")
    for name in files:
        with open(os.path.join(ROOT, name)) as f:
            source = f.read()
        lines = source.splitlines()
        above = tokens_above_banner(source) if name in ("train_gpt2.py", "mid_train.py") else None
        above = "" if above is None else f"{above:,}"
        print(f"{name:<20} {len(lines):>6,} {code_tokens(source):>12,} {above:>13} "
              f"{sum(len(l) > 120 for l in lines):>12}")
    print(f"\ncode tokens common to train_gpt2.py and mid_train.py outside shared blocks: {trainers_overlap():,}")
