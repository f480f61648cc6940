#!/usr/bin/env python3
"""structure_test.py SOURCE_DIR - the layout rules of docs/architecture.md:

- layers: common/ includes nothing of ours but itself; wire/ only common/
  and the public header; psd/ and libpsclient/ never include each other's
  headers (nor psrun's); psrun/ never includes libpsclient's private ones;
  psd/sparse/ (the table store) never includes psd/persist/ (checkpoints);
- no include cycle and no call cycle among the files of psd/ (its folders
  together), psrun/, libpsclient/src/, wire/ and common/ (a call edge: file
  A calls a function that file B defines; calls through function pointers,
  the hooks, are not edges);
- no cycle between psd/ and its folders: a file of psd/persist/ or
  psd/sparse/ may include or call a file of psd/ only if nothing that file
  depends on (includes or calls, transitively) is in that folder;
- every .c and .h base name is unique across those directories (so a
  bare #include and a file named in a comment or a doc are unambiguous);
- no function over MAX_FUNC lines and no source file over MAX_FILE lines in
  those directories (tables excepted: they are data, not functions);
- docs/layout.md names every source file of those directories (a missing
  page fails too);
- honest skips: no test in tests/*.c exits 77 itself (Check counts it as an
  error in fork mode and, without fork, it ends the suite and hides what ran
  before); a suite leaves tests out through tu_skip_tests, which makes the
  runner report the run as skipped, never as a pass.

Prints each violation and exits 1, or prints a summary (the longest
function and file) and exits 0."""
import os
import re
import sys

MAX_FUNC = 120  # lines a function may take: one screen, rarely more
MAX_FILE = 900  # lines a source file may take: one concept
DIRS = ['common', 'wire', 'libpsclient/src', 'libpsclient/include', 'libpsclient/include/ps',
        'psd', 'psd/sparse', 'psd/persist', 'psrun']
# psd's folders: checked for cycles together with psd/ itself.
SUBFOLDERS = {'psd/sparse': 'psd', 'psd/persist': 'psd'}
# Which directories' headers each directory may include (its own always).
ALLOWED = {
    'common': set(),
    # the bottom of the public headers (libuv's uv/errno.h, uv/version.h):
    # psd and the wire layer take the codes and types from there, never the
    # workers' API in psclient.h
    'libpsclient/include/ps': set(),
    'wire': {'common', 'libpsclient/include/ps'},
    'libpsclient/src': {'common', 'wire', 'libpsclient/include'},
    'libpsclient/include': {'libpsclient/include/ps'},
    'psd': {'common', 'wire', 'libpsclient/include/ps', 'psd/sparse', 'psd/persist'},
    # the sparse-table store: rows, key index, row rules, initializer, spec
    'psd/sparse': {'common', 'wire', 'libpsclient/include/ps', 'psd'},
    # checkpoints: files, directory, writer thread, scheduling and restore
    'psd/persist': {'common', 'wire', 'libpsclient/include/ps', 'psd', 'psd/sparse'},
    'psrun': {'common', 'wire', 'libpsclient/include'},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
FUNC_START = re.compile(r'^(?!typedef|struct|enum|union|static const|const |#|\s|/|\*|})'
                        r'[A-Za-z_][^;=()]*?\b([A-Za-z_]\w*)\s*\(')
CALL = re.compile(r'\b([A-Za-z_]\w*)\s*\(')


def strip_comments(text):
    text = re.sub(r'/\*.*?\*/', lambda m: '\n' * m.group(0).count('\n'), text, flags=re.S)
    text = re.sub(r'//[^\n]*', '', text)
    return re.sub(r'"(\\.|[^"\\\n])*"', '""', text)


def functions(path):
    """(name, first line, last line, static) of each function defined at
    column 0."""
    lines = strip_comments(open(path, errors='replace').read()).split('\n')
    out, i = [], 0
    while i < len(lines):
        m = FUNC_START.match(lines[i])
        if m:
            j = i
            while j < len(lines) and '{' not in lines[j] and ';' not in lines[j]:
                j += 1
            if j < len(lines) and '{' in lines[j] and ';' not in lines[j].split('{')[0]:
                k = j
                while k < len(lines) and not lines[k].startswith('}'):
                    k += 1
                out.append((m.group(1), i, k, lines[i].startswith('static')))
                i = k + 1
                continue
        i += 1
    return out, lines


def cycles(graph):
    """Every cycle found by a depth-first search, as a list of nodes."""
    found, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def component(d):
    """The directory whose files are checked for cycles together with d's."""
    return SUBFOLDERS.get(d, d)


def reach(graph, start):
    """Every node reachable from start (start included)."""
    seen, todo = {start}, [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def folder_cycles(inc_graph, call_graph, errors):
    """A file of a psd/ folder that includes or calls a file of psd/ which
    depends, in turn, on that folder: a cycle between the folders, even
    when no file-level cycle closes. Modules (a .c with its .h) are the
    nodes: includes and calls are both dependencies."""
    def module(f):
        return os.path.splitext(f)[0]
    deps = {}
    for graph in (inc_graph, call_graph):
        for a, bs in graph.items():
            for b in bs:
                if module(a) != module(b):
                    deps.setdefault(module(a), set()).add(module(b))
    for a in sorted(deps):
        fa = os.path.dirname(a)
        if fa not in SUBFOLDERS:
            continue
        for b in sorted(deps[a]):
            if os.path.dirname(b) != SUBFOLDERS[fa]:
                continue
            back = sorted(m for m in reach(deps, b) if os.path.dirname(m) == fa)
            if back:
                errors.append(f'{a}: depends on {b}, which depends on {back[0]} in {fa}/ '
                              f'(a cycle between folders)')


def main(root):
    errors = []
    owner = {}  # header name -> directory
    files = {}
    seen = {}  # base name -> first path
    for d in DIRS:
        p = os.path.join(root, d)
        if not os.path.isdir(p):
            continue
        for f in sorted(os.listdir(p)):
            if f.endswith(('.c', '.h')):
                path = os.path.join(d, f)
                files[path] = d
                if f in seen:
                    errors.append(f'{path}: the base name of {seen[f]} (names are unique '
                                  f'across folders)')
                seen.setdefault(f, path)
                if f.endswith('.h'):
                    owner.setdefault(f, d)
    longest_fn, longest_file = (0, ''), (0, '')
    for comp in sorted({component(d) for d in DIRS}):
        mine = [f for f, fd in files.items() if component(fd) == comp]
        inc_graph, call_graph, defined, bodies = {}, {}, {}, {}
        for f in mine:
            d = files[f]
            text = open(os.path.join(root, f), errors='replace').read()
            n = text.count('\n')
            longest_file = max(longest_file, (n, f))
            if n > MAX_FILE:
                errors.append(f'{f}: {n} lines (limit {MAX_FILE})')
            for h in INCLUDE.findall(text):
                hb = os.path.basename(h)
                hd = owner.get(hb)
                if hd is None:
                    continue  # generated (ps.pb-c.h) or a system header
                if h.startswith('../'):
                    hd = os.path.normpath(os.path.join(d, os.path.dirname(h)))
                if hd != d and hd not in ALLOWED[d]:
                    errors.append(f'{f}: includes {h} from {hd}/ (layer rule)')
                if component(hd) == comp:
                    inc_graph.setdefault(f, set()).add(os.path.join(hd, hb))
            if f.endswith('.c'):
                fns, lines = functions(os.path.join(root, f))
                local = {name for name, _, _, _ in fns}
                for name, a, b, static in fns:
                    if not static:
                        defined.setdefault(name, f)
                    size = b - a + 1
                    longest_fn = max(longest_fn, (size, f'{f}:{name}'))
                    if size > MAX_FUNC:
                        errors.append(f'{f}:{a + 1}: {name} is {size} lines (limit {MAX_FUNC})')
                    bodies.setdefault(f, []).append(('\n'.join(lines[a + 1:b]), local))
        for f, texts in bodies.items():
            for body, local in texts:
                for callee in CALL.findall(body):
                    to = None if callee in local else defined.get(callee)
                    if to and to != f:
                        call_graph.setdefault(f, set()).add(to)
        for c in cycles(inc_graph):
            errors.append(f'{comp}/: include cycle ' + ' -> '.join(c))
        for c in cycles(call_graph):
            errors.append(f'{comp}/: call cycle ' + ' -> '.join(c))
        folder_cycles(inc_graph, call_graph, errors)
    layout_md = os.path.join(root, 'docs', 'layout.md')
    if not os.path.exists(layout_md):
        errors.append('docs/layout.md: missing (it must name every source file)')
    else:
        layout = open(layout_md, encoding='utf-8').read()
        for f in sorted(files):
            # the whole name: conn.c is not named by srvconn.c
            if not re.search(r'(?<![\w.])' + re.escape(os.path.basename(f)) + r'(?!\w)', layout):
                errors.append(f'{f}: not in docs/layout.md')
    skip77 = re.compile(r'\b_?exit\s*\(\s*77\s*\)')
    tdir = os.path.join(root, 'tests')
    for f in sorted(os.listdir(tdir)) if os.path.isdir(tdir) else []:
        if f.endswith('.c') and f != 'runner.c':
            text = strip_comments(open(os.path.join(tdir, f), errors='replace').read())
            if skip77.search(text):
                errors.append(f'tests/{f}: exits 77 itself (use tu_skip_tests at suite '
                              f'construction)')
    for e in errors:
        print('FAIL:', e)
    print(f'longest function: {longest_fn[1]} ({longest_fn[0]} lines); '
          f'longest file: {longest_file[1]} ({longest_file[0]} lines)')
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else '.'))
