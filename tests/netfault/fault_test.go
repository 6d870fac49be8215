package netfault

import (
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// The suite's faults: one nftables table and one qdisc, both named so that
// nothing else on the machine is touched, and removed by removeFaults.
const (
	nftTable = "kvferry_netfault"
	// qdiscHandle is the handle of the tbf qdisc put on lo ("KF").
	qdiscHandle = "4b46:"
)

// faults injects packet loss, blackholes and rate limits for one test and
// removes them when the test ends. Its counters add up every rule set it
// installed.
type faults struct {
	t *testing.T

	mu            sync.Mutex
	seen, dropped uint64 // packets of the ports, and those dropped, in replaced rule sets
}

// useFaults returns t's fault injector, skipping t where faults cannot be
// injected. Whatever t leaves installed is removed when t ends.
func useFaults(t *testing.T) *faults {
	t.Helper()
	requireSuite(t)
	t.Cleanup(func() {
		if err := removeFaults(); err != nil {
			t.Errorf("removing the faults: %v", err)
		}
	})
	return &faults{t: t}
}

// drop installs a rule set that drops pct percent of the TCP packets to or
// from any of ports (100: all of them, a blackhole), chosen at random per
// packet, replacing the rules in force. Packets are dropped at prerouting,
// on the receiving side of lo: the sender sees no error, as on a lossy
// wire, where an output-hook drop would fail its send at once.
func (f *faults) drop(ports []int, pct int) {
	f.t.Helper()
	if pct <= 0 || pct > 100 || len(ports) == 0 {
		f.t.Fatalf("drop %d%% of ports %v", pct, ports)
	}
	f.accumulate()
	elems := make([]string, len(ports))
	for i, p := range ports {
		elems[i] = strconv.Itoa(p)
	}
	match := ""
	if pct < 100 {
		match = fmt.Sprintf("numgen random mod 100 < %d ", pct)
	}
	script := fmt.Sprintf(`table inet %[1]s
delete table inet %[1]s
table inet %[1]s {
	counter seen { }
	counter dropped { }
	set ports { type inet_service; elements = { %[2]s } }
	chain pre {
		type filter hook prerouting priority -300; policy accept;
		tcp dport @ports counter name "seen"
		tcp sport @ports counter name "seen"
		tcp dport @ports %[3]scounter name "dropped" drop
		tcp sport @ports %[3]scounter name "dropped" drop
	}
}
`, nftTable, strings.Join(elems, ", "), match)
	if err := nft(script); err != nil {
		f.t.Fatalf("installing %d%% loss on ports %v: %v", pct, ports, err)
	}
}

// clear removes the rules, keeping their counts.
func (f *faults) clear() {
	f.t.Helper()
	f.accumulate()
	if err := nft(fmt.Sprintf("table inet %[1]s\ndelete table inet %[1]s\n", nftTable)); err != nil {
		f.t.Fatalf("removing the rules: %v", err)
	}
}

// accumulate adds the counters of the rule set in force to the totals.
func (f *faults) accumulate() {
	f.t.Helper()
	s, d, err := ruleCounters()
	if err != nil {
		f.t.Fatalf("reading the rules' counters: %v", err)
	}
	f.mu.Lock()
	f.seen += s
	f.dropped += d
	f.mu.Unlock()
}

// counts returns the packets the rules saw and dropped since f was made.
func (f *faults) counts() (seen, dropped uint64) {
	f.t.Helper()
	s, d, err := ruleCounters()
	if err != nil {
		f.t.Fatalf("reading the rules' counters: %v", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.seen + s, f.dropped + d
}

// limit shapes everything lo sends (both directions of every connection
// on it) to mbit megabits a second, replacing an earlier limit of ours.
func (f *faults) limit(mbit int) {
	f.t.Helper()
	// The burst holds a few 64 KiB loopback packets (lo's MTU), so none is
	// too large for the bucket.
	out, err := exec.Command("tc", "qdisc", "replace", "dev", "lo", "root", "handle", qdiscHandle,
		"tbf", "rate", fmt.Sprintf("%dmbit", mbit), "burst", "256kb", "latency", "100ms").CombinedOutput()
	if err != nil {
		f.t.Fatalf("tc tbf at %d mbit on lo: %v: %s", mbit, err, bytesTrim(out))
	}
}

// unlimit removes the rate limit.
func (f *faults) unlimit() {
	f.t.Helper()
	if err := removeQdisc(); err != nil {
		f.t.Fatal(err)
	}
}

// nft runs an nft script, atomically.
func nft(script string) error {
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft: %v: %s", err, bytesTrim(out))
	}
	return nil
}

// ruleCounters reads the seen and dropped counters of our table; zeros when
// it is not there.
func ruleCounters() (seen, dropped uint64, err error) {
	out, err := exec.Command("nft", "-j", "list", "counters", "table", "inet", nftTable).Output()
	if err != nil {
		if present, perr := tablePresent(); perr == nil && !present {
			return 0, 0, nil
		}
		return 0, 0, fmt.Errorf("nft list counters: %v", err)
	}
	var doc struct {
		Nftables []struct {
			Counter *struct {
				Name    string `json:"name"`
				Packets uint64 `json:"packets"`
			} `json:"counter"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return 0, 0, fmt.Errorf("nft counters: %v", err)
	}
	for _, o := range doc.Nftables {
		if c := o.Counter; c != nil {
			switch c.Name {
			case "seen":
				seen = c.Packets
			case "dropped":
				dropped = c.Packets
			}
		}
	}
	return seen, dropped, nil
}

func tablePresent() (bool, error) {
	out, err := exec.Command("nft", "list", "tables").Output()
	if err != nil {
		return false, fmt.Errorf("nft list tables: %v", err)
	}
	return slices.Contains(strings.Split(string(out), "\n"), "table inet "+nftTable), nil
}

// qdiscPresent reports whether lo's root qdisc is ours.
func qdiscPresent() (bool, error) {
	out, err := exec.Command("tc", "qdisc", "show", "dev", "lo").CombinedOutput()
	if err != nil {
		return false, fmt.Errorf("tc qdisc show dev lo: %v: %s", err, bytesTrim(out))
	}
	return strings.Contains(string(out), " "+qdiscHandle+" root"), nil
}

func removeQdisc() error {
	ours, err := qdiscPresent()
	if err != nil || !ours {
		return err
	}
	if out, err := exec.Command("tc", "qdisc", "del", "dev", "lo", "root", "handle", qdiscHandle).CombinedOutput(); err != nil {
		return fmt.Errorf("tc qdisc del dev lo root: %v: %s", err, bytesTrim(out))
	}
	return nil
}

// faultsPresent names the faults of ours that are installed ("" when none).
func faultsPresent() (string, error) {
	var left []string
	if t, err := tablePresent(); err != nil {
		return "", err
	} else if t {
		left = append(left, "nftables table inet "+nftTable)
	}
	if q, err := qdiscPresent(); err != nil {
		return "", err
	} else if q {
		left = append(left, "the tbf qdisc "+qdiscHandle+" on lo")
	}
	return strings.Join(left, " and "), nil
}

// removeFaults removes our table and our qdisc, where present.
func removeFaults() error {
	var errs []string
	if err := nft(fmt.Sprintf("table inet %[1]s\ndelete table inet %[1]s\n", nftTable)); err != nil {
		errs = append(errs, err.Error())
	}
	if err := removeQdisc(); err != nil {
		errs = append(errs, err.Error())
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

// probeFaults installs and removes a rule and a qdisc of the kinds the
// tests use, so that a kernel without nftables or tbf is told at once.
func probeFaults() error {
	probe := fmt.Sprintf(`table inet %[1]s
delete table inet %[1]s
table inet %[1]s {
	chain pre {
		type filter hook prerouting priority -300; policy accept;
		tcp dport 9 numgen random mod 100 < 1 counter drop
	}
}
`, nftTable)
	if err := nft(probe); err != nil {
		return err
	}
	if out, err := exec.Command("tc", "qdisc", "add", "dev", "lo", "root", "handle", qdiscHandle,
		"tbf", "rate", "1gbit", "burst", "256kb", "latency", "100ms").CombinedOutput(); err != nil {
		_ = removeFaults()
		return fmt.Errorf("tc tbf on lo: %v: %s", err, bytesTrim(out))
	}
	return removeFaults()
}

// portOf returns the port of a "host:port" address.
func portOf(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	return n
}
