#!/bin/sh
# A host discovery script driven by a schedule, for `plait run --host-discovery-script`:
# `sh discover_schedule.sh SCHEDULE` prints, at its N-th run, the hosts on line N of the
# file SCHEDULE (one per output line; its last line from then on) and counts its runs in
# SCHEDULE.count. A line `fail` makes that run fail (exit 1), as a broken script would.
schedule=$1
count="$schedule.count"
n=$(( $(cat "$count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$count.tmp" && mv "$count.tmp" "$count"
total=$(wc -l < "$schedule")
line=$(( n < total ? n : total ))
hosts=$(sed -n "${line}p" "$schedule")
if [ "$hosts" = fail ]; then
    echo "scheduled failure (run $n)" >&2
    exit 1
fi
for host in $hosts; do
    echo "$host"
done
