#!/usr/bin/env bash
# Simulated hosts with network namespaces; the script ships in the package (plait/launch),
# so that `plait bench collectives --hosts N` finds it in an installed plait too.
#   scripts/netns.sh up [--hosts N] [--rate RATE] | down
exec bash "$(dirname "$0")/../src/plait/launch/netns.sh" "$@"
