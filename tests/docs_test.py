#!/usr/bin/env python3
"""docs_test.py BIN_DIR: the docs checked against the code, so that they
cannot drift (ctest `docs`). Each check names the file, the claim and what
the code says:

- every option of `psd --help`, `psrun --help` and `psctl --help` is
  documented (as `--name` in README.md or docs/), and every option in the
  option tables of docs/psd.md and docs/psrun.md (their "## Options"
  sections) exists in that program's --help;
- psd's exit statuses (psd/job.h) and the table in docs/protocol.md agree,
  both ways;
- the message types (wire/wire.h) and docs/protocol.md's §3 table agree,
  both ways, and the header section's range ("1..N") is the real one;
- the protocol minor (wire/wire.h) is the one docs/psd.md's
  `--protocol-minor` row names.

Then it plants four contradictions in a copy of the docs (a wrong exit
status, a wrong type range, an option psrun does not have in
docs/psrun.md's table, a wrong minor in docs/psd.md's row) and fails
unless every one is found: the check itself is checked."""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def help_options(binary):
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = p.stdout + p.stderr
    return set(re.findall(r"^\s+(?:-[a-zA-Z], )?(--[a-z0-9][a-z0-9-]*)", text, re.M))


def section(text, heading):
    """The lines of a page's section under `heading` (to the next ## or the end)."""
    m = re.search(r"^## %s\b.*?$(.*?)(?=^## |\Z)" % re.escape(heading), text, re.M | re.S)
    return m.group(1) if m else ""


def table_options(text):
    """Options named in the first column of a Markdown table's rows."""
    out = set()
    for line in text.splitlines():
        if line.startswith("| `--"):
            first = line.split("|")[1]
            out |= set(re.findall(r"`(--[a-z0-9][a-z0-9-]*)", first))
    return out


# Each program's option table: the "## Options" section of its page in docs/.
OPTION_TABLES = (("psd", "psd.md"), ("psrun", "psrun.md"), ("psctl", None))


def check_options(bin_dir, readme, docs, pages, errors):
    documented = set(re.findall(r"`(--[a-z0-9][a-z0-9-]*)", readme + docs))
    for prog, page in OPTION_TABLES:
        have = help_options(os.path.join(bin_dir, prog))
        if not have:
            errors.append("%s --help lists no options" % prog)
            continue
        for opt in sorted(have - documented):
            errors.append("%s --help has %s, which README.md and docs/ never mention" % (prog, opt))
        if page:
            table = table_options(section(pages.get(page, ""), "Options"))
            if not table:
                errors.append("docs/%s has no option table under \"## Options\"" % page)
            for opt in sorted(table - have):
                errors.append("docs/%s's option table documents %s, which `%s --help` does not "
                              "have" % (page, opt, prog))


def check_exits(protocol, errors):
    public = dict(re.findall(r"#define (PS_[A-Z_]+) (\d+)",
                             read(os.path.join(ROOT, "libpsclient", "include", "ps",
                                               "errno.h"))))
    code = dict((n, int(public.get(v, v))) for n, v in re.findall(
        r"(PSD_EXIT_[A-Z_]+) = (\d+|PS_[A-Z_]+)", read(os.path.join(ROOT, "psd", "job.h"))))
    doc = dict((n, int(v)) for v, n in re.findall(r"^\| (\d+) \| `(PSD_EXIT_[A-Z_]+)`",
                                                  protocol, re.M))
    for n in sorted(set(code) | set(doc)):
        if code.get(n) != doc.get(n):
            errors.append("exit status %s: psd/job.h says %s, docs/protocol.md's table says %s"
                          % (n, code.get(n), doc.get(n)))


def check_messages(protocol, errors):
    wire = read(os.path.join(ROOT, "wire", "wire.h"))
    code = dict((n, int(v)) for n, v in re.findall(r"PS__MSG_([A-Z_]+?) = (\d+)", wire))
    last = max(v for n, v in code.items() if n != "MAX_")
    code.pop("MAX_", None)
    types = re.search(r"^## 3\. Message types(.*?)(?=^## )", protocol, re.M | re.S)
    doc = dict((n, int(v)) for v, n in re.findall(r"^\| (\d+) \| ([A-Z_]+) \|",
                                                  types.group(1) if types else "", re.M))
    for n in sorted(set(code) | set(doc)):
        if code.get(n) != doc.get(n):
            errors.append("message type %s: wire/wire.h says %s, docs/protocol.md §3 says %s"
                          % (n, code.get(n), doc.get(n)))
    for k in re.findall(r"type[s]?,? (?:of )?(?:0 or of )?1\.\.(\d+)", protocol):
        if int(k) != last:
            errors.append("docs/protocol.md says message types run 1..%s; wire/wire.h's last "
                          "is %d" % (k, last))
    for k in re.findall(r"or of (\d+) and above", protocol):
        if int(k) != last + 1:
            errors.append("docs/protocol.md refuses types from %s; wire/wire.h's first invalid "
                          "one is %d" % (k, last + 1))


def check_minor(psd_page, errors):
    m = re.search(r"#define PS__PROTOCOL_MINOR (\d+)u", read(os.path.join(ROOT, "wire",
                                                                        "wire.h")))
    row = [line for line in section(psd_page, "Options").splitlines()
           if line.startswith("| `--protocol-minor")]
    if not m or not row:
        errors.append("no PS__PROTOCOL_MINOR in wire/wire.h or no --protocol-minor row in "
                      "docs/psd.md's option table")
    elif "(%s)" % m.group(1) not in row[0]:
        errors.append("docs/psd.md's --protocol-minor row does not name this psd's minor (%s): %s"
                      % (m.group(1), row[0]))


def contradictions(bin_dir, docs_dir):
    readme = read(os.path.join(docs_dir, "README.md"))
    pages = dict((os.path.basename(f), read(f))
                 for f in sorted(glob.glob(os.path.join(docs_dir, "docs", "*.md"))))
    docs = "".join(pages.values())
    protocol = pages.get("protocol.md", "")
    errors = []
    check_options(bin_dir, readme, docs, pages, errors)
    check_exits(protocol, errors)
    check_messages(protocol, errors)
    check_minor(pages.get("psd.md", ""), errors)
    return errors


def plant(path, old, new):
    """Replaces the first `old` (a regular expression) in the file; fails if absent."""
    text = read(path)
    changed = re.sub(old, new, text, 1, re.M)
    if changed == text:
        raise SystemExit("docs_test.py: cannot plant a contradiction in %s: no %r"
                         % (path, old))
    with open(path, "w", encoding="utf-8") as f:
        f.write(changed)


def planted_are_found(bin_dir):
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(os.path.join(ROOT, "README.md"), d)
        shutil.copytree(os.path.join(ROOT, "docs"), os.path.join(d, "docs"))
        docs = os.path.join(d, "docs")
        plant(os.path.join(docs, "protocol.md"), r"^\| 75 \| `PSD_EXIT_STOPPED`",
              "| 76 | `PSD_EXIT_STOPPED`")
        plant(os.path.join(docs, "protocol.md"), r"the message type, 1\.\.\d+",
              "the message type, 1..17")
        plant(os.path.join(docs, "psrun.md"), r"^(\| `--grace S` .*)$",
              "\\1\n| `--planted-option` | | not psrun's | |")
        plant(os.path.join(docs, "psd.md"), r"^(\| `--protocol-minor N` \| this psd's )\(\d+\)",
              "\\1(999)")
        found = contradictions(bin_dir, d)
    want = ("exit status PSD_EXIT_STOPPED", "message types run 1..17",
            "documents --planted-option", "row does not name this psd's minor")
    missed = [w for w in want if not any(w in e for e in found)]
    for w in missed:
        print("FAIL: a planted contradiction (%s) was not found" % w)
    return not missed


def main():
    bin_dir = sys.argv[1]
    errors = contradictions(bin_dir, ROOT)
    for e in errors:
        print("FAIL: " + e)
    print("docs: %d contradiction(s)" % len(errors))
    planted = planted_are_found(bin_dir)
    print("docs: the planted contradictions were %s" % ("found" if planted else "NOT found"))
    return 1 if errors or not planted else 0


if __name__ == "__main__":
    sys.exit(main())
