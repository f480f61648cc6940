#!/usr/bin/env bash
# psplot - pictures of a training run, drawn by gnuplot:
#   training.png   loss, test accuracy and images/s against step and wall
#                  time (from cifar_worker --metrics, or any JSON lines with
#                  "step", "wall_s", "loss", "images_per_sec", "test_accuracy")
#   breakdown.png  per rank, the median step split into compute / push /
#                  wait / pull, the straggler marked, and every rank's step
#                  time over the run (from psrun --telemetry PREFIX: the
#                  workers' PREFIX.w<i> and psd's PREFIX.ps0)
# The record formats are in docs/telemetry.md.
set -euo pipefail

usage() {
  cat <<EOF
usage: psplot [--metrics FILE] [--telemetry PREFIX] [--out DIR] [--size WxH]
  --metrics FILE      the chief's cifar_worker --metrics file -> DIR/training.png
  --telemetry PREFIX  psrun --telemetry PREFIX files -> DIR/breakdown.png
  --out DIR           where the pictures go [.]
  --size WxH          pixels of each picture [1200x900]
At least one of --metrics and --telemetry is needed.
EOF
}

die() { echo "psplot: $*" >&2; exit 2; }

metrics="" prefix="" out="." size="1200x900"
while [ $# -gt 0 ]; do
  case "$1" in
    --metrics) [ $# -ge 2 ] || die "--metrics needs a file"; metrics=$2; shift 2 ;;
    --telemetry) [ $# -ge 2 ] || die "--telemetry needs a prefix"; prefix=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; out=$2; shift 2 ;;
    --size) [ $# -ge 2 ] || die "--size needs WxH"; size=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$metrics$prefix" ] || die "nothing to plot: give --metrics FILE and/or --telemetry PREFIX"
[[ "$size" =~ ^([0-9]{2,5})x([0-9]{2,5})$ ]] || die "--size must be WIDTHxHEIGHT in pixels, got '$size'"
width=${BASH_REMATCH[1]} height=${BASH_REMATCH[2]}
if ! command -v gnuplot >/dev/null 2>&1; then
  echo "psplot: gnuplot is not installed; install it (Debian: apt-get install gnuplot-nox)" >&2
  exit 3
fi
[ -z "$metrics" ] || [ -s "$metrics" ] || die "--metrics $metrics is missing or empty"
mkdir -p "$out" || die "cannot create --out $out"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/psplot.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# JSON lines -> whitespace-separated columns ("?" where a key is absent).
# Numbers only; keys are matched as "key": so the records' field order is free.
columns() { # file key...
  local f=$1; shift
  awk -v keys="$*" '
    BEGIN { n = split(keys, k, " ") }
    /^\{/ {
      line = ""
      for (i = 1; i <= n; i++) {
        v = "?"
        if (match($0, "\"" k[i] "\":-?[0-9.eE+-]+")) {
          v = substr($0, RSTART + length(k[i]) + 3, RLENGTH - length(k[i]) - 3)
        }
        line = line (i > 1 ? " " : "") v
      }
      print line
    }' "$f"
}

term="set terminal pngcairo size $width,$height font 'sans,10' noenhanced"

if [ -n "$metrics" ]; then
  columns "$metrics" step wall_s loss images_per_sec test_accuracy > "$tmp/m.dat"
  [ -s "$tmp/m.dat" ] || die "--metrics $metrics holds no JSON lines"
  gnuplot <<EOF || die "gnuplot failed on the training curve"
$term
set output '$out/training.png'
set datafile missing '?'
set grid
set key off
set multiplot layout 3,2 title 'training: $(basename "$metrics")'
set xlabel 'step'
set ylabel 'loss'
plot '$tmp/m.dat' using 1:3 with lines lw 2 lc rgb '#1f77b4'
set xlabel 'wall time (s)'
plot '$tmp/m.dat' using 2:3 with lines lw 2 lc rgb '#1f77b4'
set xlabel 'step'
set ylabel 'test accuracy'
set yrange [0:1]
plot '$tmp/m.dat' using 1:5 with linespoints pt 7 lw 2 lc rgb '#2ca02c'
set xlabel 'wall time (s)'
plot '$tmp/m.dat' using 2:5 with linespoints pt 7 lw 2 lc rgb '#2ca02c'
set autoscale y
set yrange [0:*]
set xlabel 'step'
set ylabel 'images/s (all workers)'
plot '$tmp/m.dat' using 1:4 with lines lw 2 lc rgb '#d62728'
set xlabel 'wall time (s)'
plot '$tmp/m.dat' using 2:4 with lines lw 2 lc rgb '#d62728'
unset multiplot
EOF
  echo "psplot: wrote $out/training.png"
fi

median() { # column file -> median of that column
  awk -v c="$1" '$c != "?" { print $c }' "$2" | sort -g |
    awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print 0 }'
}

if [ -n "$prefix" ]; then
  shopt -s nullglob
  files=("$prefix".w*)
  [ ${#files[@]} -gt 0 ] || die "no worker telemetry files $prefix.w<i> (psrun --telemetry $prefix)"
  # The straggler: most often last at ps0 (else the slowest median step).
  straggler="" share=""
  if [ -s "$prefix.ps0" ]; then
    read -r cnt straggler < <(grep -o '"last":[0-9]*' "$prefix.ps0" | sed 's/.*://' | sort -n |
                               uniq -c | sort -rn | head -1) || true
    total=$(grep -c '"type":"ps"' "$prefix.ps0" || true)
    [ -n "$straggler" ] && [ "${total:-0}" -gt 0 ] && share=$(( 100 * cnt / total ))
  fi
  : > "$tmp/bars.dat"
  plots=()
  for f in "${files[@]}"; do
    rank=${f##*.w}
    [[ "$rank" =~ ^[0-9]+$ ]] || continue
    columns "$f" step compute_ms push_ms wait_ms pull_ms step_ms > "$tmp/w$rank.dat"
    [ -s "$tmp/w$rank.dat" ] || continue
    label="w$rank"
    [ "$rank" = "$straggler" ] && label="w$rank (straggler)"
    echo "\"$label\" $(median 2 "$tmp/w$rank.dat") $(median 3 "$tmp/w$rank.dat") $(median 4 "$tmp/w$rank.dat") $(median 5 "$tmp/w$rank.dat")" >> "$tmp/bars.dat"
    lw=1; [ "$rank" = "$straggler" ] && lw=3
    plots+=("'$tmp/w$rank.dat' using 1:(\$2+\$6) with lines lw $lw title '$label'")
  done
  [ -s "$tmp/bars.dat" ] || die "the files $prefix.w<i> hold no step records"
  sort -t'"' -k2,2V -o "$tmp/bars.dat" "$tmp/bars.dat"
  title="step time per rank (median, ms)"
  [ -n "$straggler" ] && title="$title - straggler: w$straggler, last to arrive in ${share:-?}% of steps"
  series=$(IFS=,; echo "${plots[*]}")
  gnuplot <<EOF || die "gnuplot failed on the breakdown"
$term
set output '$out/breakdown.png'
set multiplot layout 2,1 title '$title'
set style data histograms
set style histogram rowstacked
set style fill solid 0.85 border -1
set boxwidth 0.6
set grid ytics
set ylabel 'ms per step (median)'
set key outside right top
set yrange [0:*]
plot '$tmp/bars.dat' using 2:xtic(1) title 'compute' lc rgb '#1f77b4', \
     '' using 3 title 'push' lc rgb '#ff7f0e', \
     '' using 4 title 'wait for aggregate' lc rgb '#d62728', \
     '' using 5 title 'pull' lc rgb '#2ca02c'
set style data lines
set grid
set xlabel 'step'
set ylabel 'compute + step (ms)'
set logscale y
set yrange [*:*]
plot $series
unset multiplot
EOF
  echo "psplot: wrote $out/breakdown.png"
fi
