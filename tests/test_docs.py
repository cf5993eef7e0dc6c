"""The docs' links resolve: every relative link in README.md, docs/*.md and bench/*.md names a file that exists, an
anchor names a heading of its page, and nothing links into a heading of bench/RESULTS.md or bench/LOG.md, whose
headings change as figures do (link to the page)."""

import glob
import os
import re

from conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NO_ANCHORS = {os.path.join("bench", "RESULTS.md"), os.path.join("bench", "LOG.md")}


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # a '#' line in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_link_in_the_docs_resolves():
    pages = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO)),
             *sorted(glob.glob("bench/*.md", root_dir=REPO))]
    broken = []
    for page in pages:
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(REPO, file)):
                broken.append(f"{page}: {target}: no file {file}")
            elif anchor and file in NO_ANCHORS:
                broken.append(f"{page}: {target}: link to the page, not into its headings")
            elif anchor and anchor not in anchors(os.path.join(REPO, file)):
                broken.append(f"{page}: {target}: no heading #{anchor} in {file}")
    assert not broken, "\n".join(broken)
