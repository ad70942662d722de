#!/usr/bin/env bash
# Turn this machine into N "hosts" joined by a switch, with Linux network namespaces
# (scripts/netns.sh in a checkout runs this file; plait.launch.hosts uses it too).
#
#   scripts/netns.sh up [--hosts N] [--rate RATE]   # N (default 2) hosts; RATE e.g. 1gbit
#   scripts/netns.sh down                           # remove everything `up` made; safe twice
#
# Topology (needs root: CAP_SYS_ADMIN and CAP_NET_ADMIN):
#
#   plait-h0 [eth0 10.77.0.1/24] --veth-- [h0 \
#   plait-h1 [eth0 10.77.0.2/24] --veth-- [h1  br0]  plait-sw
#   ...                                   [.. /
#
# Every namespace has its loopback up. Each host's interface is called eth0 in every host.
# The hosts share this machine's hostname, which resolves to loopback; plait.init() points
# gloo at the engine's interface itself (GLOO_SOCKET_IFNAME=eth0 for other programs). Run a command on host i
# with `ip netns exec plait-hI cmd`, and set PLAIT_NODE_ID per host: the hostname cannot
# tell the hosts apart.
#
# With --rate, a token bucket (tc tbf) limits both ends of every host's link: the host's
# eth0 (what it sends) and the switch's hI (what it receives). tbf shapes egress only,
# hence one on each end. The burst (64kb) was accurate to about 5% at 1gbit here; set
# PLAIT_NETNS_BURST for much faster rates. There is no latency emulation (no netem).
set -euo pipefail

PREFIX=plait
SWITCH=${PREFIX}-sw
SUBNET=10.77.0
BURST=${PLAIT_NETNS_BURST:-64kb}

die() {
    echo "netns.sh: error: $*" >&2
    exit 1
}

usage() {
    sed -n '5,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# The namespaces a previous `up` made: plait-sw and plait-h<digits>, nothing else.
ours() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(sw|h[0-9]+)$" || true
}

down() {
    local ns
    for ns in $(ours); do
        # processes still inside keep a namespace alive after its name is gone: stop them
        local pids
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || die "could not delete namespace $ns"
    done
}

check_permitted() {
    command -v ip >/dev/null || die "the 'ip' command (iproute2) is not installed"
    local probe="${PREFIX}-probe-$$" msg
    if ! msg=$(ip netns add "$probe" 2>&1); then
        die "cannot create network namespaces ('ip netns add' said: $msg); run as root" \
            "(this needs CAP_SYS_ADMIN and CAP_NET_ADMIN; uid is $(id -u))"
    fi
    ip netns del "$probe"
}

up() {
    local hosts=2 rate=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --hosts) [ $# -ge 2 ] || usage; hosts=$2; shift 2 ;;
            --hosts=*) hosts=${1#*=}; shift ;;
            --rate) [ $# -ge 2 ] || usage; rate=$2; shift 2 ;;
            --rate=*) rate=${1#*=}; shift ;;
            *) echo "netns.sh: unknown argument '$1'" >&2; usage ;;
        esac
    done
    [[ "$hosts" =~ ^[0-9]+$ ]] && [ "$hosts" -ge 1 ] && [ "$hosts" -le 253 ] ||
        die "--hosts must be an integer in 1..253 (one /24 address each), got '$hosts'"
    check_permitted
    if [ -n "$rate" ]; then
        command -v tc >/dev/null || die "--rate needs the 'tc' command (iproute2)"
    fi
    down  # leftovers of an earlier run, so that `up` can be repeated

    trap 'echo "netns.sh: up failed; removing what it made" >&2; down' ERR
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link set lo up
    ip -n "$SWITCH" link add br0 type bridge forward_delay 0 stp_state 0
    ip -n "$SWITCH" link set br0 up
    local i ns
    for ((i = 0; i < hosts; i++)); do
        ns=${PREFIX}-h$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # both ends are made inside the namespaces: nothing touches the root namespace
        ip -n "$SWITCH" link add "h$i" type veth peer name eth0 netns "$ns"
        ip -n "$SWITCH" link set "h$i" master br0
        ip -n "$SWITCH" link set "h$i" up
        ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [ -n "$rate" ]; then
            ip netns exec "$ns" tc qdisc add dev eth0 root tbf \
                rate "$rate" burst "$BURST" latency 50ms
            ip netns exec "$SWITCH" tc qdisc add dev "h$i" root tbf \
                rate "$rate" burst "$BURST" latency 50ms
        fi
    done
    trap - ERR
    echo "netns.sh: $hosts host(s) ${PREFIX}-h0..${PREFIX}-h$((hosts - 1))" \
        "at $SUBNET.1..$SUBNET.$hosts on eth0, rate ${rate:-unlimited}"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down)
        shift
        [ $# -eq 0 ] || usage
        command -v ip >/dev/null || die "the 'ip' command (iproute2) is not installed"
        down
        ;;
    *) usage ;;
esac
