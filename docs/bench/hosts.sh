#!/bin/sh
# Simulated hosts for `tensorwire bench collectives --netns`, made as the multi-host tests make
# theirs (tests/src/netns.rs): one network namespace per host, joined by a bridge in a namespace
# of its own; host i has eth0 with 10.78.0.<i+1>/24 and lo. Needs root and iproute2.
#
#   hosts.sh up N [PREFIX]     makes N hosts and prints the --netns argument
#   hosts.sh down N [PREFIX]   removes them
set -eu
cmd=$1
n=$2
p=${3:-twbench}
case "$cmd" in
up)
    ip netns add "${p}sw"
    ip -n "${p}sw" link add br0 type bridge
    ip -n "${p}sw" link set br0 up
    arg=""
    i=0
    while [ "$i" -lt "$n" ]; do
        ns="${p}h$i"
        addr="10.78.0.$((i + 1))"
        ip netns add "$ns"
        ip link add eth0 netns "$ns" type veth peer name "h$i" netns "${p}sw"
        ip -n "${p}sw" link set "h$i" master br0
        ip -n "${p}sw" link set "h$i" up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        arg="${arg:+$arg,}$ns=$addr"
        i=$((i + 1))
    done
    echo "$arg"
    ;;
down)
    i=0
    while [ "$i" -lt "$n" ]; do
        ip netns del "${p}h$i" 2>/dev/null || true
        i=$((i + 1))
    done
    ip netns del "${p}sw" 2>/dev/null || true
    ;;
*)
    echo "usage: hosts.sh up|down N [PREFIX]" >&2
    exit 2
    ;;
esac
