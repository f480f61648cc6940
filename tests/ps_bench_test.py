#!/usr/bin/env python3
"""ps_bench_test.py BIN_DIR rounds|mpi|table MPI_BUILT - ps_bench's interleaved
rounds and their statistics, from its --json output (examples/ps_bench).

rounds: `ps_bench --rounds 3 --sizes 4,64K --tcp-baseline --memcpy-baseline`,
  then `--sizes 1M` (gbps ratios) and `--transport tcp,shm` (each psd run
  over both, back to back, and shm's step time over tcp's as a ratio)
  - every figure has exactly one line per round, and the rounds interleave:
    the lines come in round order, and within a round every baseline comes
    before the psd runs (tcp_stream, tcp_rtt, memcpy per size, pushpull);
  - each "summary" carries the per-round values of those lines, in round
    order, and its median / min / max are the median / min / max of them
    (so the median lies within the range);
  - each "ratio" is the ratio of the two summaries' medians, and its
    per-round values are the per-round ratios;
  - bad --rounds values are refused with a message naming the option.

table: `ps_bench --table 2k:4 --rounds 1` and `--table-store --table 4k:8`
  - a table run then the dense push+pull of its row bytes, each with its
    fields (keys, dim, keys_per_s = keys / step), and their ratio;
  - the store's insert and find rates and each rule's update against the
    copy of its rows; bad --table values are refused naming the option.

mpi: `ps_bench --rounds 2 --sizes 4,64K --workers 1,2 --mpi-baseline` with
  `--mpi-arg`s choosing an allreduce algorithm (named in a "note" line)
  - exits 77 (SKIP) when Open MPI is not installed (no mpirun) and ps_bench
    was built without it; fails when mpirun is installed but the baseline
    was not built (MPI_BUILT OFF: reconfigure), or when it runs but fails;
  - otherwise one mpi_allreduce_shm and one mpi_allreduce_tcp line per
    round, worker count and size, interleaved with the psd runs, and the
    ratios of psd's step time to MPI's for 1 and 2 workers.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys

TIMEOUT_S = 600  # the whole run; the ctest TIMEOUT is above it


def fail(msg):
    print('FAIL: ' + msg)
    sys.exit(1)


def run_bench(bin_dir, args):
    cmd = [os.path.join(bin_dir, 'ps_bench'), '--json', '--no-pin'] + args
    print('+ ' + ' '.join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=TIMEOUT_S)
    if p.returncode != 0:
        fail('ps_bench exited %d\n--- stdout\n%s--- stderr\n%s' %
             (p.returncode, p.stdout, p.stderr[-6000:]))
    rows = []
    for line in p.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            fail('not a JSON line: %r' % line)
    return rows


def key(r):
    """Which figure a line or summary is about."""
    name = r.get('of', r['name'])
    return (name, r['bytes'], r.get('ps', 0), r.get('workers', 0), r.get('transport'))


def close(a, b):
    """Equal up to the 6 significant digits ps_bench prints."""
    return abs(a - b) <= 2e-5 * max(abs(a), abs(b)) + 1e-12


def check_rounds(rows, rounds, baselines):
    per_round = [r for r in rows if r['name'] not in ('summary', 'ratio', 'note')]
    if not per_round:
        fail('no per-round lines')
    # Round order, and in each round the baselines before psd.
    seen_round = 0
    for r in per_round:
        if r.get('round') not in range(1, rounds + 1):
            fail('line without a round 1..%d: %r' % (rounds, r))
        if r['round'] < seen_round:
            fail('round %d after round %d: the rounds do not follow each other' %
                 (r['round'], seen_round))
        seen_round = r['round']
    for rnd in range(1, rounds + 1):
        names = [r['name'] for r in per_round if r['round'] == rnd]
        first_psd = names.index('pushpull') if 'pushpull' in names else len(names)
        if any(n == 'pushpull' for n in names[:first_psd]) or \
           any(n != 'pushpull' for n in names[first_psd:]):
            fail('round %d is not baselines then psd: %s' % (rnd, names))
        for b in baselines:
            if b not in names[:first_psd]:
                fail('round %d has no %s line before psd: %s' % (rnd, b, names))
    # One line per figure and round.
    values = {}
    for r in per_round:
        values.setdefault(key(r), {})
        if r['round'] in values[key(r)]:
            fail('two lines for %s in round %d' % (key(r), r['round']))
        if 'step_ms' not in r:
            fail('a failed measurement: %r' % r)
        values[key(r)][r['round']] = r
    summaries = {key(r): r for r in rows if r['name'] == 'summary'}
    if set(summaries) != set(values):
        fail('summaries %s vs figures %s' % (sorted(summaries), sorted(values)))
    for k, by_round in values.items():
        if sorted(by_round) != list(range(1, rounds + 1)):
            fail('%s measured in rounds %s, not 1..%d' % (k, sorted(by_round), rounds))
        s = summaries[k]
        if s['rounds'] != rounds or s['ok_rounds'] != rounds:
            fail('summary %s: rounds %s ok_rounds %s' % (k, s['rounds'], s['ok_rounds']))
        for metric in ('step_ms', 'gbps'):
            got = [by_round[i].get(metric) for i in range(1, rounds + 1)]
            if s[metric] != got:
                fail('summary %s %s = %s, the lines say %s' % (k, metric, s[metric], got))
            if got[0] is None:
                continue
            med, lo, hi = s[metric + '_median'], s[metric + '_min'], s[metric + '_max']
            if not (close(med, statistics.median(got)) and lo == min(got) and hi == max(got)):
                fail('summary %s %s: median %s [%s-%s] of %s' % (k, metric, med, lo, hi, got))
            if not lo <= med <= hi:
                fail('summary %s %s: median %s outside [%s, %s]' % (k, metric, med, lo, hi))
    return summaries


def check_ratios(rows, summaries, rounds, expect):
    """expect: (vs, bytes, workers, metric) that must have a ratio line."""
    ratios = [r for r in rows if r['name'] == 'ratio']
    found = set()
    for r in ratios:
        m = r['of']
        psd = summaries[('pushpull', r['bytes'], r['ps'], r['workers'], r.get('transport'))]
        if r['vs'] == 'tcp_stream':
            base = [v for k, v in summaries.items() if k[0] == 'tcp_stream']
        elif r['vs'] == 'pushpull':
            if r.get('vs_transport') != 'tcp' or r.get('transport') in (None, 'tcp'):
                fail('ratio %r: pushpull against pushpull is some transport against tcp' % r)
            base = [summaries.get(('pushpull', r['bytes'], r['ps'], r['workers'], 'tcp'))]
        else:
            mpi = r['vs'].startswith('mpi_allreduce')
            base = [summaries.get((r['vs'], r['bytes'], 0, r['workers'] if mpi else 0, None))]
        if len(base) != 1 or base[0] is None:
            fail('ratio %r: no single baseline summary' % r)
        base = base[0]
        if not close(r['value'], psd[m + '_median'] / base[m + '_median']):
            fail('ratio %r is not %s / %s' % (r, psd[m + '_median'], base[m + '_median']))
        per = [a / b for a, b in zip(psd[m], base[m])]
        if len(r['per_round']) != rounds or \
           not all(close(a, b) for a, b in zip(r['per_round'], per)):
            fail('ratio %r: per round %s, expected %s' % (r, r['per_round'], per))
        if not r['per_round_min'] <= r['per_round_median'] <= r['per_round_max']:
            fail('ratio %r: median outside the range' % r)
        found.add((r['vs'] + ('/' + r['vs_transport'] if 'vs_transport' in r else ''),
                   r['bytes'], r['workers'], m))
    missing = set(expect) - found
    if missing:
        fail('no ratio line for %s (found %s)' % (sorted(missing), sorted(found)))


def test_bad_options(bin_dir):
    for bad in ('0', '102', 'x', '-1', ''):
        p = subprocess.run([os.path.join(bin_dir, 'ps_bench'), '--rounds', bad],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=60)
        if p.returncode != 2 or '--rounds' not in p.stderr:
            fail('--rounds %r: exit %d, %r' % (bad, p.returncode, p.stderr))
    for bad in ('tcp,tcp', 'udp', 'tcp,', ''):
        p = subprocess.run([os.path.join(bin_dir, 'ps_bench'), '--transport', bad],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=60)
        if p.returncode != 2 or '--transport' not in p.stderr:
            fail('--transport %r: exit %d, %r' % (bad, p.returncode, p.stderr))


def test_rounds(bin_dir):
    test_bad_options(bin_dir)
    rounds = 3
    rows = run_bench(bin_dir, ['--rounds', str(rounds), '--sizes', '4,64K', '--steps', '5',
                               '--tcp-baseline', '--memcpy-baseline'])
    summaries = check_rounds(rows, rounds, ['tcp_stream', 'tcp_rtt', 'memcpy'])
    if len([k for k in summaries if k[0] == 'memcpy']) != 2:
        fail('memcpy is not measured for both sizes: %s' % sorted(summaries))
    check_ratios(rows, summaries, rounds, [('tcp_rtt', 4, 1, 'step_ms')])
    # 1 MiB and up: gbps against tcp_stream and memcpy.
    rows = run_bench(bin_dir, ['--rounds', '2', '--sizes', '1M', '--steps', '3',
                               '--tcp-baseline', '--memcpy-baseline'])
    summaries = check_rounds(rows, 2, ['tcp_stream', 'tcp_rtt', 'memcpy'])
    check_ratios(rows, summaries, 2, [('tcp_stream', 1 << 20, 1, 'gbps'),
                                      ('memcpy', 1 << 20, 1, 'gbps')])
    # Several transports: every psd run over each, in the same round, tcp
    # then shm back to back, and shm's step time against tcp's.
    rows = run_bench(bin_dir, ['--rounds', '2', '--sizes', '4,64K', '--steps', '5',
                               '--transport', 'tcp,shm'])
    summaries = check_rounds(rows, 2, [])
    runs = [r for r in rows if r['name'] == 'pushpull']
    if [r.get('transport') for r in runs] != ['tcp', 'shm'] * 4:
        fail('pushpull runs over %s, not tcp then shm per size and round' %
             [r.get('transport') for r in runs])
    check_ratios(rows, summaries, 2, [('pushpull/tcp', 4, 1, 'step_ms'),
                                      ('pushpull/tcp', 65536, 1, 'step_ms')])


def test_mpi(bin_dir, built):
    if not built:
        if shutil.which('mpirun') or shutil.which('mpiexec'):
            fail('Open MPI is installed (mpirun) but ps_bench was built without the MPI '
                 'baseline: reconfigure the build (cmake) to pick it up')
        rows = run_bench(bin_dir, ['--rounds', '1', '--sizes', '4', '--steps', '2',
                                   '--mpi-baseline'])
        if not any(r.get('mpi_baseline') == 'not built' for r in rows):
            fail('ps_bench did not say "MPI baseline: not built"')
        print('SKIP: Open MPI is not installed (deploy/deps.sh installs openmpi-bin '
              'libopenmpi-dev); ps_bench says it was not built')
        sys.exit(77)
    rounds = 2
    # --mpi-arg reaches mpirun (an allreduce algorithm of Open MPI's tuned
    # collectives) and the JSON names it.
    algo = ['--mpi-arg=--mca', '--mpi-arg=coll_tuned_use_dynamic_rules', '--mpi-arg=1',
            '--mpi-arg=--mca', '--mpi-arg=coll_tuned_allreduce_algorithm', '--mpi-arg=2']
    rows = run_bench(bin_dir, ['--rounds', str(rounds), '--sizes', '4,64K', '--steps', '5',
                               '--workers', '1,2', '--mpi-baseline'] + algo)
    want = '--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 2'
    if not any(r.get('mpi_args') == want for r in rows):
        fail('no note naming the --mpi-arg arguments: %s' %
             [r for r in rows if r['name'] == 'note'])
    summaries = check_rounds(rows, rounds, ['mpi_allreduce_shm', 'mpi_allreduce_tcp'])
    for fig in ('mpi_allreduce_shm', 'mpi_allreduce_tcp'):
        for w in (1, 2):
            for b in (4, 65536):
                if (fig, b, 0, w, None) not in summaries:
                    fail('no %s for %d workers x %d B' % (fig, w, b))
    check_ratios(rows, summaries, rounds,
                 [(fig, b, w, 'step_ms') for fig in ('mpi_allreduce_shm', 'mpi_allreduce_tcp')
                  for w in (1, 2) for b in (4, 65536)])


def expect_refused(bin_dir, args, flag):
    p = subprocess.run([os.path.join(bin_dir, 'ps_bench')] + args, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=60)
    if p.returncode != 2 or flag not in p.stderr:
        fail('%s: exit %d, %r' % (args, p.returncode, p.stderr))


def positive(row, *fields):
    for f in fields:
        if not isinstance(row.get(f), (int, float)) or not row[f] > 0:
            fail('%s is not a positive number in %r' % (f, row))


def test_table(bin_dir):
    for bad in ('0:4', '10', '4:0', '2k:4,', 'x:4'):
        expect_refused(bin_dir, ['--table', bad], '--table')
    expect_refused(bin_dir, ['--table-store'], '--table')
    # Table steps and the dense push+pull of the same row bytes, back to
    # back, and their ratio.
    keys, dim = 2000, 4
    rows = run_bench(bin_dir, ['--table', '2k:4', '--rounds', '1', '--steps', '2',
                               '--transport', 'tcp'])
    names = [r['name'] for r in rows if r['name'] not in ('summary', 'ratio')]
    if names != ['table', 'pushpull']:
        fail('lines %s, not a table run then its dense run' % names)
    t = [r for r in rows if r['name'] == 'table'][0]
    d = [r for r in rows if r['name'] == 'pushpull'][0]
    if 'warning' in t or t['keys'] != keys or t['dim'] != dim or \
       t['bytes'] != keys * dim * 4 or d['bytes'] != t['bytes']:
        fail('table line %r / dense line %r' % (t, d))
    positive(t, 'step_ms', 'gbps', 'keys_per_s')
    if not close(t['keys_per_s'], keys / (t['step_ms'] * 1e-3)) and \
       abs(t['keys_per_s'] - keys / (t['step_ms'] * 1e-3)) > 1e-5 * t['keys_per_s']:
        fail('keys_per_s %s is not keys / step: %r' % (t['keys_per_s'], t))
    summaries = [r for r in rows if r['name'] == 'summary']
    if sorted(s['of'] for s in summaries) != ['pushpull', 'table']:
        fail('summaries %r' % summaries)
    ratio = [r for r in rows if r['name'] == 'ratio' and r.get('table')]
    if len(ratio) != 1 or ratio[0]['keys'] != keys or ratio[0]['vs'] != 'pushpull' or \
       not close(ratio[0]['value'], t['step_ms'] / d['step_ms']):
        fail('no ratio of the table step to the dense one: %r' % ratio)
    # The store alone: find-or-insert, each rule's update and the copy.
    rows = run_bench(bin_dir, ['--table-store', '--table', '4k:8', '--rounds', '1'])
    store = [r for r in rows if r['name'] == 'table_store']
    upd = [r for r in rows if r['name'] == 'table_update']
    if len(store) != 1 or store[0]['keys'] != 4000 or store[0]['dim'] != 8:
        fail('table_store lines %r' % store)
    positive(store[0], 'insert_keys_per_s', 'find_keys_per_s')
    if [u['rule'] for u in upd] != ['sgd', 'adagrad', 'adam', 'ftrl']:
        fail('table_update lines %r' % upd)
    for u in upd:
        positive(u, 'rows_per_s', 'rule_rows_per_s', 'copy_rows_per_s', 'ratio', 'rule_ratio')
        if not close(u['ratio'], u['rows_per_s'] / u['copy_rows_per_s']) or \
           not close(u['rule_ratio'], u['rule_rows_per_s'] / u['copy_rows_per_s']):
            fail('ratio of %r' % u)
    for of in ('update_over_copy', 'rule_over_copy'):
        if not any(r['name'] == 'summary' and r['of'] == of for r in rows):
            fail('no %s summary' % of)


def main():
    if len(sys.argv) != 4 or sys.argv[2] not in ('rounds', 'mpi', 'table'):
        print(__doc__)
        sys.exit(2)
    bin_dir, what, built = sys.argv[1], sys.argv[2], sys.argv[3] == 'ON'
    if what == 'rounds':
        test_rounds(bin_dir)
    elif what == 'table':
        test_table(bin_dir)
    else:
        test_mpi(bin_dir, built)
    print('PASS: ps_bench ' + what)


if __name__ == '__main__':
    main()
