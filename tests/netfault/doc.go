// Package netfault holds kvferry's network-fault suite: transfers between
// two engines in two processes while the packets between them are dropped
// at random (nftables), dropped altogether for seconds (a blackhole), or
// slowed (tc tbf), and while either process is paused or killed. The
// package has no API: the tests are in its _test.go files.
//
// The test process runs the test binary again as a peer (peerproc_test.go):
// an engine with one registered buffer that it fills, checks, aborts
// requests of, and transfers from, as the test asks over its stdin and
// stdout (internal/childproc starts it and carries the lines). In most
// tests the peer is the owner of the memory (the target) and the test
// process the initiator; in those where the initiator is paused or killed
// the roles are swapped.
//
// The faults change packet filtering and a queueing discipline, so the
// suite runs only when KVFERRY_NETFAULT=1 (`make test-netfault`, alone,
// after the other Go tests), as root, with nft, tc and ip installed;
// otherwise every test skips and says why. It runs in a network namespace
// of its own where the kernel allows one (its rules and qdisc then vanish
// with the namespace whatever ends the run); where not, on the host's
// loopback, with a janitor process that removes them when the test process
// exits by any means (main_test.go).
package netfault
