# Two network namespaces joined by a veth pair (MTU 1500), the stand-in for two hosts, for the
# side-by-side scripts (sourced by compare.sh and preload_bench.sh). Before `netns_up`, set
# NS_A and NS_B (the namespaces: server side, client side), NS_VETH (a short prefix for the
# pair's interface names) and NS_NET (the first three octets of a /24): NS_A gets NS_NET.1,
# NS_B NS_NET.2. `netns_down` removes both namespaces (and with them the pair).

netns_down() {
    ip netns del "$NS_A" 2> /dev/null || true
    ip netns del "$NS_B" 2> /dev/null || true
}

netns_up() {
    local a="$NS_VETH-a-$$" b="$NS_VETH-b-$$"
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    ip link add "$a" type veth peer name "$b"
    ip link set "$a" netns "$NS_A"
    ip link set "$b" netns "$NS_B"
    ip -n "$NS_A" addr add "$NS_NET.1/24" dev "$a"
    ip -n "$NS_B" addr add "$NS_NET.2/24" dev "$b"
    for ns in "$NS_A" "$NS_B"; do
        ip -n "$ns" link set lo up
    done
    ip -n "$NS_A" link set "$a" mtu 1500 up
    ip -n "$NS_B" link set "$b" mtu 1500 up
}
