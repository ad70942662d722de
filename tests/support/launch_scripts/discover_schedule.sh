#!/bin/sh
# A host discovery script driven by a schedule, for `plait run --host-discovery-script`:
# `sh discover_schedule.sh SCHEDULE [PROGRESS]` prints the hosts on line N of the file
# SCHEDULE, one per output line (its last line once N is past the end), where N is this
# run's number (counted in SCHEDULE.runs), or, given PROGRESS, 1 + the number of lines
# in that file (the ranks append to it, so the schedule follows the job, as Horovod's
# tests follow their ranks' log). A line `fail` makes the run fail (exit 1).
schedule=$1
if [ -n "$2" ]; then
    n=$(( $(cat "$2" 2>/dev/null | wc -l) + 1 ))
else
    echo run >> "$schedule.runs"
    n=$(wc -l < "$schedule.runs")
fi
total=$(wc -l < "$schedule")
line=$(( n < total ? n : total ))
hosts=$(sed -n "${line}p" "$schedule")
if [ "$hosts" = fail ]; then
    echo "scheduled failure (line $line)" >&2
    exit 1
fi
for host in $hosts; do
    echo "$host"
done
