#!/usr/bin/env bash
# A/B of the verifier's level-1 rates between an older tree and this one, in one device call: the
# level-1 part of evidence_h200.sh (reward rate, timed rate cold and cached, the clock against in-process
# CUDA events) from each tree in the order old, new, old, new (ROUNDS rounds), one build cache for all,
# so only the first run compiles. Each run's files under $OUT/{old,new}_N/; the cached rates, their means
# and new/old, and each problem's mean flush and call seconds a candidate, in $OUT/ab.txt.
#
# The older tree, made here and carried (".ab" is git-ignored):
#   mkdir -p .ab/old && git archive <commit> | tar -x -C .ab/old
# then, on the device, from the repository root (carry ".gpu_data" and ".ab"):
#   OUT=/some/dir OLD=.ab/old bash experiments/gpu/ab_level1.sh
# FIRST_S (default 250) limits the first run (it builds the ten candidates), EACH (default 240) the others:
# each run spends ~46 s starting the service and warming the PCH, and `verifier bench` skips a pass with
# under 60 s of its budget left (EACH=150 left no cached pass). TIMED_PASSES (default 4: cold, then 3
# cached) passes of each run; every cached pass counts. Two runs of 240 s fit one 600 s device call: set
# ROUNDS=1 (default 2) there.
set -u
: "${OUT:?set OUT}"
: "${OLD:?set OLD (a tree of the older code)}"
cd "$(dirname "$0")/../.."
NEW=$PWD
OLD=$(realpath "$OLD")
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
ln -sfn "$NEW/.gpu_data" "$OLD/.gpu_data"
export VERIFIER_CACHE_DIR=${VERIFIER_CACHE_DIR:-${TMPDIR:-/tmp}/ab_level1_builds}
limit=${FIRST_S:-250}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    tree=$OLD
    [ "$side" = new ] && tree=$NEW
    OUT="$OUT/${side}_$r" TIMED_PASSES=${TIMED_PASSES:-4} PARTS=level1 BUDGET=$((limit + 10)) LEVEL1_S=$limit \
      bash "$tree/experiments/gpu/evidence_h200.sh" > /dev/null 2>&1
    echo "$side $r: $(grep -E '^timed_cached' "$OUT/${side}_$r/status.txt" | cut -c1-60 | tr '\n' ' ')" | tee -a "$OUT/ab.txt"
    limit=${EACH:-240}
  done
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/ab.txt"
import glob, json, os, statistics, sys
out = sys.argv[1]
rates, problems = {"old": [], "new": []}, {"old": {}, "new": {}}
for path in sorted(glob.glob(os.path.join(out, "*_*", "level1.json"))):
    side = os.path.basename(os.path.dirname(path)).split("_")[0]
    try:
        d = json.load(open(path))["gpu_level1"]
    except Exception as e:  # a run cut by its limit
        print(path, "no report:", e)
        continue
    for tag in sorted(t for t in d if t.startswith("timed_cached")):
        if isinstance(d[tag], dict):  # a skipped pass is a string
            rates[side].append(d[tag]["candidates_per_min"])
            for name, ph in d[tag].get("per_problem_phases", {}).items():
                p = problems[side].setdefault(name, {"timing_flush": [], "timing_call": []})
                for k in p:
                    p[k].append(ph.get(k, 0.0))
for side, r in rates.items():
    print(side, "cached rates", [round(x, 1) for x in r], "mean", round(statistics.fmean(r), 2) if r else None)
if rates["old"] and rates["new"]:
    print("new/old", round(statistics.fmean(rates["new"]) / statistics.fmean(rates["old"]), 3))
print("problem: flush s old -> new | call s old -> new (means a candidate)")
for name in problems["new"]:
    o, n = problems["old"].get(name), problems["new"][name]
    if o:
        m = lambda p, k: statistics.fmean(p[k])
        print(f"{name[:32]:32s} {m(o, 'timing_flush'):.3f} -> {m(n, 'timing_flush'):.3f} | "
              f"{m(o, 'timing_call'):.3f} -> {m(n, 'timing_call'):.3f}")
PY
