# What the sampler GPU scripts share (sourced, not run): the start (the clock, $OUT made absolute, the
# repository root as the working directory, the environment), a budget of BUDGET s, a status line per part
# in $OUT/status.txt, PARTS as a comma list, and `part`, which runs one part's command under the time
# left. The sourcing script sets BUDGET and PARTS after it.
# A device call returns at most 8 files of its $OUT (/work/.library/device/README.md), and one part can
# write more (logs, HLO, profiles): the parts write under a work folder outside it (OUT below), and after
# each part everything there is packed into $OUT/results.tgz, so $OUT holds two files: results.tgz and
# status.txt (a call cut by its limit keeps what the last finished part packed).
set -u
START=$(date +%s)
: "${OUT:?set OUT}"
mkdir -p "$OUT" && BACK=$(cd "$OUT" && pwd)
OUT=$(mktemp -d /tmp/gpu_parts.XXXXXX)
pack() { tar czf "$BACK/.results.tgz" -C "$OUT" . && mv "$BACK/.results.tgz" "$BACK/results.tgz"; }
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
left() { echo $((BUDGET - ($(date +%s) - START))); }
status() { echo "$(($(date +%s) - START)) s: $*" | tee -a "$BACK/status.txt"; }
has() { [[ ",$PARTS," == *",$1,"* ]]; }
# The GPU host has no grain: the carried wheels (.whl/: `pip download --only-binary=:all: --python-version
# 3.12 --platform manylinux_2_28_x86_64 --no-deps -d .whl grain array_record portpicker`) go into
# /tmp/site where python3 cannot import it (without them a run fails at its first import, in seconds).
if ! python3 -c "import grain" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    status "grain: installed from .whl/ into /tmp/site"
  fi
fi
rows() { if [ -f "$OUT/results.jsonl" ]; then grep -c '"run"' "$OUT/results.jsonl"; else echo 0; fi; }
# part NAME MIN_S COMMAND...: COMMAND under the time left (less 5 s), skipped with less than MIN_S;
# returns COMMAND's status.
part() {
  local name=$1 min=$2 lim rc
  shift 2
  lim=$(($(left) - 5))
  if [ "$lim" -lt "$min" ]; then
    status "$name: skipped ($(left) s left, needs $min)"
    return
  fi
  timeout -k 5 "$lim" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  status "$name: exit $rc (limit $lim s; $(rows) rows in results.jsonl;" \
    "last: $(grep -v '^[WIE][0-9]' "$OUT/$name.log" | tail -1 | cut -c1-160))"
  pack
  return $rc
}
