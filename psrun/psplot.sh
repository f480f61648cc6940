#!/usr/bin/env bash
# psplot - pictures of a training run, drawn by gnuplot from JSON lines
# parsed by jq:
#   training.png   loss, test accuracy and images/s against step and wall
#                  time (from cifar_worker --metrics, or any JSON lines with
#                  some of "step", "wall_s", "loss", "images_per_sec",
#                  "test_accuracy"; docs/telemetry.md, "Metrics lines")
#   breakdown.png  per rank, the median step split into compute / push /
#                  wait / pull, the straggler marked, and every rank's step
#                  time over the run (from psrun --telemetry PREFIX: the
#                  workers' PREFIX.w<i> and psd's PREFIX.ps0)
# The record formats are in docs/telemetry.md. A key missing from a file
# leaves out the plots that need it, with a sentence naming key and file;
# nothing to plot at all is an error (exit 2). The pictures are drawn in a
# private temporary directory and written by `psctl save` (next to psplot),
# psd's rules for output files: mode 0600, and a symbolic link at DIR/NAME,
# or another user's file or directory, refused (exit 2), never written
# through.
set -euo pipefail

usage() {
  cat <<EOF
usage: psplot [--metrics FILE] [--telemetry PREFIX] [--out DIR] [--size WxH]
  --metrics FILE      JSON lines (cifar_worker --metrics) -> DIR/training.png
  --telemetry PREFIX  psrun --telemetry PREFIX files -> DIR/breakdown.png
  --out DIR           where the pictures go [.]
  --size WxH          pixels of each picture [1200x900]
At least one of --metrics and --telemetry is needed. Needs gnuplot and jq.
EOF
}

die() { echo "psplot: $*" >&2; exit 2; }
say() { echo "psplot: $*" >&2; }

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
for tool in gnuplot:gnuplot-nox jq:jq; do
  if ! command -v "${tool%%:*}" >/dev/null 2>&1; then
    echo "psplot: ${tool%%:*} is not installed; install it (Debian: apt-get install ${tool#*:})" >&2
    exit 3
  fi
done
psctl=$(dirname "$0")/psctl
[ -x "$psctl" ] || die "cannot find psctl, which writes the pictures, next to psplot ($psctl)"
[ -z "$metrics" ] || [ -s "$metrics" ] || die "--metrics $metrics is missing or empty"
mkdir -p "$out" || die "cannot create --out $out"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/psplot.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# table FILE OUT KEY...: the JSON lines of FILE -> OUT, one line per JSON
# object with the KEYs' values as whitespace-separated columns ("?" where a
# key is absent or not a finite number). Any spacing and key order; blank
# lines are ignored; other lines that are not JSON objects are skipped with
# one sentence naming the file, how many and the first.
table() {
  local f=$1 dest=$2; shift 2
  jq -R -r --arg keys "$*" '
    ($keys | split(" ")) as $k
    | (try fromjson catch null) as $o
    | if ($o | type) == "object" then
        [$k[] as $key | $o[$key]
         | if type == "number" and (isnan | not) and (isinfinite | not) then tostring else "?" end]
        | join(" ")
      elif test("^\\s*$") then "#blank"
      else "#bad" end' "$f" > "$tmp/raw" || die "jq could not read $f"
  grep -v '^#' "$tmp/raw" > "$dest" || true
  local bad first
  bad=$(grep -c '^#bad$' "$tmp/raw" || true)
  if [ "$bad" -gt 0 ]; then
    first=$(grep -n -m1 '^#bad$' "$tmp/raw" | cut -d: -f1)
    say "$f: skipped $bad line(s) that are not JSON objects (the first is line $first)"
  fi
}

# present DAT COLUMN: whether any line of DAT has a value in that column.
present() { awk -v c="$2" '$c != "?" { found = 1; exit } END { exit !found }' "$1"; }
# together DAT C1 C2: whether some line has values in both columns.
together() { awk -v a="$2" -v b="$3" '$a != "?" && $b != "?" { found = 1; exit } END { exit !found }' "$1"; }

# place NAME: $tmp/NAME (drawn there, in our private directory) to
# $out/NAME through psctl save: one implementation of the output rules.
place() {
  local msg
  msg=$("$psctl" save "$out/$1" < "$tmp/$1" 2>&1) || die "${msg#psctl: }"
  echo "psplot: wrote $out/$1"
}

term="set terminal pngcairo size $width,$height font 'sans,10' noenhanced"

# training.png: a panel per y key (loss, test_accuracy, images_per_sec)
# and x key (step, wall_s) that occur together in the file; the test
# accuracy panels add test_accuracy_average (cifar_worker --average: the
# servers' moving average) when the file has it.
training_plot() {
  local f=$1 dat=$tmp/m.dat
  table "$f" "$dat" step wall_s loss test_accuracy images_per_sec test_accuracy_average
  local avg=0
  present "$dat" 6 && avg=1
  [ -s "$dat" ] || die "--metrics $f holds no JSON objects (one per line, see docs/telemetry.md)"
  local xkeys=(step wall_s) xlabels=("step" "wall time (s)") xnames=("step" "wall time")
  local ykeys=(loss test_accuracy images_per_sec)
  local ylabels=("loss" "test accuracy" "images/s (all workers)")
  local ynames=("loss" "test-accuracy" "images/s")
  local ystyles=("lines lw 2 lc rgb '#1f77b4'" "linespoints pt 7 lw 2 lc rgb '#2ca02c'"
                 "lines lw 2 lc rgb '#d62728'")
  local yranges=("set autoscale y" "set yrange [0:1]" "set yrange [0:*]")
  local xs=() ys=() i j k
  for i in 0 1; do
    if present "$dat" $((i + 1)); then xs+=("$i")
    else say "no line of $f has a numeric \"${xkeys[$i]}\": leaving out the plots against ${xnames[$i]}"; fi
  done
  for j in 0 1 2; do
    if present "$dat" $((j + 3)); then ys+=("$j")
    else say "no line of $f has a numeric \"${ykeys[$j]}\": leaving out the ${ynames[$j]} plots"; fi
  done
  [ ${#xs[@]} -gt 0 ] || die "nothing to plot from $f: no line has a numeric \"step\" or \"wall_s\" to plot against"
  [ ${#ys[@]} -gt 0 ] || die "nothing to plot from $f: no line has a numeric \"loss\", \"test_accuracy\" or \"images_per_sec\""
  local panels="" n=0
  for j in "${ys[@]}"; do
    for i in "${xs[@]}"; do
      if ! together "$dat" $((i + 1)) $((j + 3)); then
        say "no line of $f has both \"${xkeys[$i]}\" and \"${ykeys[$j]}\": leaving out that plot"
        continue
      fi
      local series="'$dat' using $((i + 1)):$((j + 3)) with ${ystyles[$j]}" key="set key off"
      if [ "$j" = 1 ] && [ "$avg" = 1 ]; then
        series+=" title 'parameters', '$dat' using $((i + 1)):6 with linespoints pt 6 lw 2 lc rgb '#9467bd' title 'moving average'"
        key="set key bottom right"
      fi
      panels+="set xlabel '${xlabels[$i]}'
set ylabel '${ylabels[$j]}'
${yranges[$j]}
$key
plot $series
"
      n=$((n + 1))
    done
  done
  [ "$n" -gt 0 ] || die "nothing to plot from $f: no line has a value to plot together with its step or wall time"
  local cols=${#xs[@]}
  [ "$n" -ge "$cols" ] || cols=$n
  k=$(( (n + cols - 1) / cols ))
  gnuplot <<EOF || die "gnuplot failed on the training curve"
$term
set output '$tmp/training.png'
set datafile missing '?'
set grid
set key off
set multiplot layout $k,$cols title 'training: $(basename "$f")'
$panels
unset multiplot
EOF
  place training.png
}

if [ -n "$metrics" ]; then
  training_plot "$metrics"
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
    table "$prefix.ps0" "$tmp/ps0.dat" last
    read -r cnt straggler < <(awk '$1 ~ /^[0-9]+$/ { print $1 }' "$tmp/ps0.dat" | sort -n |
                               uniq -c | sort -rn | head -1) || true
    total=$(wc -l < "$tmp/ps0.dat")
    [ -n "$straggler" ] && [ "${total:-0}" -gt 0 ] && share=$(( 100 * cnt / total ))
  fi
  : > "$tmp/bars.dat"
  plots=()
  for f in "${files[@]}"; do
    rank=${f##*.w}
    [[ "$rank" =~ ^[0-9]+$ ]] || continue
    table "$f" "$tmp/w$rank.dat" step compute_ms push_ms wait_ms pull_ms step_ms
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
set output '$tmp/breakdown.png'
set datafile missing '?'
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
  place breakdown.png
fi
