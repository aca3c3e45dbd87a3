#!/usr/bin/env bash
# Runs benchmark commands one after another in the background, in a process session of their own, so that they
# outlive the shell or remote command that started them (a long-context step takes longer than many job systems let
# one command run), and collects what they wrote later:
#
#     bash benchmarks/queue.sh start DIR 'python benchmarks/long_context_sft.py --tokens 327680 --steps 2 --out DIR' \
#         'python benchmarks/long_context_sft.py --tokens 458752 --steps 1 --out DIR'
#     bash benchmarks/queue.sh wait DIR SECONDS [COPY_TO]
#
# start: writes the commands to DIR/commands and starts them, one at a time in that order, each through bash in the
#        current directory; DIR/progress gets a line as each starts and as it ends (with its exit status) and "done"
#        after the last; DIR/<n>.log is the n-th command's output. Refused while a queue still runs in DIR.
# wait:  returns when the queue is done or SECONDS have passed, printing the progress and each log's last lines.
#        With COPY_TO, copies DIR's *.json and *.md, the progress and the logs' last 200 lines (progress bars left
#        out) there, every 2 s while it waits: what a command wrote before it was cut short is kept.
#        Exit status: 0 when every command ended with 0, 1 when one did not, 3 while the queue still runs.
# (run is start's background half.)
set -u
verb=${1:?usage: queue.sh start DIR COMMAND... | queue.sh wait DIR SECONDS [COPY_TO]}
dir=${2:?the directory of the queue}

running() { [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null && ! grep -q '^done' "$dir/progress" 2>/dev/null; }

log_tail() { tr '\r' '\n' <"$1" | grep -v 'it/s\]\|s/it\]' | tail -"$2"; }

collect() {
    mkdir -p "$1"
    cp "$dir/progress" "$1/"
    for f in "$dir"/*.json "$dir"/*.md; do [ -f "$f" ] && cp "$f" "$1/"; done
    for f in "$dir"/[0-9]*.log; do [ -f "$f" ] && log_tail "$f" 200 >"$1/$(basename "$f")"; done
}

case "$verb" in
start)
    shift 2
    [ $# -gt 0 ] || { echo "queue.sh: no commands to start" >&2; exit 2; }
    mkdir -p "$dir"
    if running; then echo "queue.sh: a queue still runs in $dir (pid $(cat "$dir/pid"))" >&2; exit 1; fi
    printf '%s\n' "$@" >"$dir/commands"
    : >"$dir/progress"
    setsid bash "$0" run "$dir" >/dev/null 2>&1 </dev/null &
    echo $! >"$dir/pid"
    echo "queue.sh: started $# command(s) in $dir"
    ;;
run)
    n=0
    while IFS= read -r command; do
        n=$((n + 1))
        echo "start $n $(date +%T) $command" >>"$dir/progress"
        bash -c "$command" >"$dir/$n.log" 2>&1 </dev/null
        rc=$?
        echo "end $n $(date +%T) rc=$rc" >>"$dir/progress"
    done <"$dir/commands"
    echo "done $(date +%T)" >>"$dir/progress"
    ;;
wait)
    seconds=${3:?how many seconds to wait}
    copy_to=${4:-}
    deadline=$((SECONDS + seconds))
    while running && [ "$SECONDS" -lt "$deadline" ]; do
        [ -n "$copy_to" ] && collect "$copy_to"
        sleep 2
    done
    [ -n "$copy_to" ] && collect "$copy_to"
    cat "$dir/progress"
    for f in "$dir"/[0-9]*.log; do [ -f "$f" ] && { echo "== $f"; log_tail "$f" 25 | cut -c1-300; }; done
    if running; then exit 3; fi
    if grep -q ' rc=[1-9]' "$dir/progress" || ! grep -q '^done' "$dir/progress"; then exit 1; fi
    ;;
*)
    echo "queue.sh: unknown verb '$verb' (start, wait)" >&2
    exit 2
    ;;
esac
