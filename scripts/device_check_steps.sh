# The device check's step runner (sourced by scripts/device_check.sh; tests/test_device_check.py drives it with
# fake steps). Bash only, no Python: it must report even when the machine's Python is broken.
#
#   source scripts/device_check_steps.sh
#   dc_begin RESULTS_DIR BUDGET_S [ARCHIVE] # results (logs, JSON, the table) go to RESULTS_DIR; with ARCHIVE, the
#                                           # archive is rewritten after every step (a run cut short keeps it)
#   dc_step NAME LIMIT_S CMD [ARG...]       # CMD under `timeout`, output to RESULTS_DIR/NAME.log; returns its status
#   dc_stop "why"                           # every later step is recorded SKIP with this reason, not run
#   dc_finish [ARCHIVE]                     # the table (stdout + table.txt, summary.json), ARCHIVE (tar.gz) of
#                                           # RESULTS_DIR (dc_begin's when not given); returns 0 only if every step
#                                           # passed
#
# A step is PASS (exit 0), FAIL (any other exit), TIMEOUT (killed at its limit: `timeout` exits 124, or 137
# when TERM was not enough and KILL followed 10 s later) or SKIP (not run: dc_stop, or the budget was spent).
# Each step gets its own limit, cut to what is left of the budget (less DC_RESERVE_S for the archive); a
# step that would get less than DC_MIN_STEP_S is skipped. `timeout` signals the step's whole process group,
# so its children (pytest workers, subprocesses) end with it. With TRITON_CACHE_DIR set, the table also
# counts the Triton kernels each step compiled (new *.cubin files in the cache).

DC_RESERVE_S=${DC_RESERVE_S:-10}
DC_MIN_STEP_S=${DC_MIN_STEP_S:-5}

dc_begin() {  # RESULTS_DIR BUDGET_S [ARCHIVE]
  DC_DIR=$1
  DC_BUDGET_S=$2
  DC_ARCHIVE=${3:-}
  DC_START=$SECONDS
  DC_STOP_REASON=""
  DC_ROWS=()
  mkdir -p "$DC_DIR"
}

dc_stop() {  # REASON
  DC_STOP_REASON=$1
}

_dc_compiles() {  # the number of compiled Triton kernels in the cache, or - without one
  if [ -n "${TRITON_CACHE_DIR:-}" ]; then
    find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l | tr -d ' '
  else
    echo -
  fi
}

_dc_record() {  # NAME STATUS SECONDS LIMIT COMPILES EXIT NOTE; the archive is rewritten with the new row
  DC_ROWS+=("$1|$2|$3|$4|$5|$6|$7")
  if [ -n "$DC_ARCHIVE" ]; then
    _dc_archive "$DC_ARCHIVE" >/dev/null || echo "[device_check] could not write $DC_ARCHIVE"
  fi
}

_dc_archive() {  # ARCHIVE: table.txt and summary.json as they stand, then RESULTS_DIR packed into ARCHIVE (whole
  # or not at all: written beside it, then renamed)
  local archive=$1
  dc_table >"$DC_DIR/table.txt"
  dc_summary_json >"$DC_DIR/summary.json"
  mkdir -p "$(dirname "$archive")" &&
    tar -czf "$archive.partial" -C "$(dirname "$DC_DIR")" "$(basename "$DC_DIR")" &&
    mv -f "$archive.partial" "$archive"
}

dc_step() {  # NAME LIMIT_S CMD [ARG...]
  local name=$1 limit=$2
  shift 2
  local left=$((DC_BUDGET_S - (SECONDS - DC_START) - DC_RESERVE_S))
  if [ -n "$DC_STOP_REASON" ]; then
    _dc_record "$name" SKIP 0 "$limit" - - "not run: $DC_STOP_REASON"
    echo "[device_check] $name: SKIP ($DC_STOP_REASON)"
    return 1
  fi
  if [ "$left" -lt "$DC_MIN_STEP_S" ]; then
    _dc_record "$name" SKIP 0 "$limit" - - "not run: the check's ${DC_BUDGET_S} s budget is spent"
    echo "[device_check] $name: SKIP (the ${DC_BUDGET_S} s budget is spent)"
    return 1
  fi
  local note=""
  if [ "$left" -lt "$limit" ]; then
    note="limit cut from $limit s to the $left s left of the budget"
    limit=$left
  fi
  local before after compiles rc status t0=$SECONDS
  before=$(_dc_compiles)
  echo "[device_check] $name: running (limit $limit s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$DC_DIR/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  after=$(_dc_compiles)
  compiles=-
  if [ "$before" != - ]; then compiles=$((after - before)); fi
  if [ "$rc" -eq 0 ]; then
    status=PASS
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=TIMEOUT
    note="killed at its $limit s limit${note:+; $note}"
  else
    status=FAIL
  fi
  _dc_record "$name" "$status" "$took" "$limit" "$compiles" "$rc" "${note:-$name.log}"
  echo "[device_check] $name: $status in $took s (exit $rc, $compiles Triton compiles)"
  if [ "$status" != PASS ]; then
    echo "---- last lines of $name.log ----"
    tail -n 30 "$DC_DIR/$name.log"
    echo "----"
  fi
  [ "$status" = PASS ]
}

dc_table() {  # the table, to stdout
  local row name status took limit compiles rc note
  local passed=0 failed=0 timeouts=0 skipped=0
  printf '%-16s %-8s %8s %8s %9s %5s  %s\n' step status seconds limit compiles exit note
  for row in "${DC_ROWS[@]}"; do
    IFS='|' read -r name status took limit compiles rc note <<<"$row"
    printf '%-16s %-8s %8s %8s %9s %5s  %s\n' "$name" "$status" "$took" "$limit" "$compiles" "$rc" "$note"
    case $status in
      PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;;
      TIMEOUT) timeouts=$((timeouts + 1)) ;; SKIP) skipped=$((skipped + 1)) ;;
    esac
  done
  echo "${#DC_ROWS[@]} steps: $passed passed, $failed failed, $timeouts timed out, $skipped skipped;" \
    "$((SECONDS - DC_START)) s of the ${DC_BUDGET_S} s budget"
}

_dc_json_string() {  # a JSON string of $1 (backslashes and quotes escaped; no control characters expected)
  local s=${1//\\/\\\\}
  printf '"%s"' "${s//\"/\\\"}"
}

dc_summary_json() {  # the rows as JSON, to stdout
  local row name status took limit compiles rc note first=1
  printf '{"budget_s": %s, "elapsed_s": %s, "steps": [' "$DC_BUDGET_S" "$((SECONDS - DC_START))"
  for row in "${DC_ROWS[@]}"; do
    IFS='|' read -r name status took limit compiles rc note <<<"$row"
    [ $first = 1 ] || printf ', '
    first=0
    [ "$compiles" = - ] && compiles=null
    [ "$rc" = - ] && rc=null
    printf '\n  {"step": %s, "status": "%s", "seconds": %s, "limit_s": %s, "compiles": %s, "exit": %s, "note": %s}' \
      "$(_dc_json_string "$name")" "$status" "$took" "$limit" "$compiles" "$rc" "$(_dc_json_string "$note")"
  done
  printf '\n]}\n'
}

dc_ok() {  # whether every step passed (and there was one)
  local row
  [ "${#DC_ROWS[@]}" -gt 0 ] || return 1
  for row in "${DC_ROWS[@]}"; do
    case $row in *"|PASS|"*) ;; *) return 1 ;; esac
  done
}

dc_finish() {  # [ARCHIVE]: print and keep the table, pack RESULTS_DIR into ARCHIVE; 0 only if every step passed
  local archive=${1:-$DC_ARCHIVE}
  echo
  dc_table
  if _dc_archive "$archive"; then
    echo "[device_check] results: $archive ($(du -k "$archive" | cut -f1) KB: the logs, JSON and this table)"
  else
    echo "[device_check] could not write $archive"
    return 2
  fi
  if dc_ok; then
    echo "[device_check] PASS: every step passed"
    return 0
  fi
  echo "[device_check] FAIL: not every step passed (table above)"
  return 1
}
