// Package cluster holds kvferry's simulated multi-host cluster test: eight
// hosts (four prefill, four decode; KVFERRY_CLUSTER_HOSTS changes the
// count), each a network namespace with a veth into a bridge in a "switch"
// namespace, and one more namespace running etcd, where the engines keep
// their segment metadata. Each host runs tests/cluster/node, an engine on
// its own address; the test drives them over stdin and stdout with
// all-to-all prefill-to-decode traffic, aborts and fences, and checks every
// byte that landed, while it kills a decode host, cuts a link, drops
// packets and kills etcd. It prints a report of each phase.
//
// It needs root, ip, nft, tc and etcd, and it creates namespaces and a
// bridge (never touching the host's own interfaces or routes), so it runs
// only when KVFERRY_CLUSTER=1 (`make test-cluster`); otherwise it skips
// and says why. Everything it creates is named with a prefix of its own
// run and removed at the end, by the test and by a janitor process that
// outlives it however it ends; a run also removes what an earlier run,
// killed before its janitor could act, left behind.
package cluster
