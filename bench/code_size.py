"""
Code size of each script in code tokens: every Python token except comments, newlines and indentation, with each
docstring one token whatever its length (the module's none), so that neither comments, docstrings nor packing code
onto fewer lines changes the count. This is issue 30's measure: it gives that issue's table for its commit 42d6ae7.

    python bench/code_size.py            # a table: lines, code tokens, lines over 120 characters
"""

import ast
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


def code_tokens(source):
    docs = docstrings(source)
    return sum(1 for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in LAYOUT
               and not (t.type == tokenize.STRING and docs.get(t.start[0])))


if __name__ == "__main__":
    print(f"{'file':<20} {'lines':>6} {'code tokens':>12} {'lines > 120':>12}")
    for name in sys.argv[1:] or SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            source = f.read()
        lines = source.splitlines()
        print(f"{name:<20} {len(lines):>6,} {code_tokens(source):>12,} {sum(len(l) > 120 for l in lines):>12}")
