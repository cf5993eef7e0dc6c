"""
Code size of each script in code tokens: every Python token except comments, docstrings, newlines and indentation,
so that neither comments nor packing code onto fewer lines changes the count (issue 30's measure).

    python bench/code_size.py            # a table: lines, code tokens, lines over 120 characters
"""

import ast
import io
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["train_gpt2.py", "mid_train.py", "hellaswag.py", "sample.py", "export_hf.py", "prepare_fineweb.py"]
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
          tokenize.ENCODING}


def docstring_lines(source):
    """The (first, last) lines of every docstring: a string standing alone as a module's, class's or def's first line."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                spans.append((first.lineno, first.end_lineno))
    return spans


def code_tokens(source):
    docs = docstring_lines(source)
    return sum(1 for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in LAYOUT
               and not (t.type == tokenize.STRING and any(a <= t.start[0] <= b for a, b in docs)))


if __name__ == "__main__":
    print(f"{'file':<20} {'lines':>6} {'code tokens':>12} {'lines > 120':>12}")
    for name in sys.argv[1:] or SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            source = f.read()
        lines = source.splitlines()
        print(f"{name:<20} {len(lines):>6,} {code_tokens(source):>12,} {sum(len(l) > 120 for l in lines):>12}")
