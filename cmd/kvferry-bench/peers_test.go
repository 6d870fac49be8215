package main

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestMain lets the test binary stand in for kvferry-bench: peers mode
// starts this program again as its subject (--mode peers-subject), and
// under go test this program is the test binary.
func TestMain(m *testing.M) {
	if len(os.Args) > 2 && os.Args[1] == "--mode" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestParsePeerCounts(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []int
	}{
		{"2,8,32,128,256", []int{2, 8, 32, 128, 256}},
		{" 3 , 5", []int{3, 5}},
		{"0", nil},
		{"2,,8", nil},
		{"4097", nil},
		{"two", nil},
	} {
		got, err := parsePeerCounts(tc.in)
		if tc.want == nil {
			if err == nil {
				t.Errorf("%q: got %v, want an error", tc.in, got)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%q: got %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

// Two peers and a subject in a process of its own: every pair has all its
// paths dialed both ways and one control connection each way, and the
// subject costs more descriptors and goroutines than alone. Short
// heartbeat intervals, given as KVFERRY_* variables as a user would,
// reach the subject and keep the run to seconds.
func TestPeersModeMeasuresTwoPeers(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a subject process and waits out heartbeat intervals")
	}
	t.Setenv("KVFERRY_HEARTBEAT_MS", "100")
	t.Setenv("KVFERRY_IDLE_HEARTBEAT_MS", "2000")
	t.Setenv("KVFERRY_PATHS_PER_PEER", "3")
	set, err := peerSettingsFromEnv(0)
	if err != nil {
		t.Fatal(err)
	}
	c := config{host: "127.0.0.1"}
	const inUse = 500 * time.Millisecond
	alone, err := measurePeers(c, 0, set, inUse)
	if err != nil {
		t.Fatal(err)
	}
	two, err := measurePeers(c, 2, set, inUse)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("alone: %+v", alone)
	t.Logf("two peers: %+v", two)
	if two.paths != 2*3 || two.dataConns != 2*3 || two.controlIn != 2 || two.controlOut != 2 {
		t.Errorf("two peers of 3 paths: the subject has %d paths, %d data connections, %d control connections in and %d out; want 6, 6, 2, 2",
			two.paths, two.dataConns, two.controlIn, two.controlOut)
	}
	if two.fds <= alone.fds || two.goroutines <= alone.goroutines {
		t.Errorf("two peers cost nothing: fds %d -> %d, goroutines %d -> %d", alone.fds, two.fds, alone.goroutines, two.goroutines)
	}
	if two.rssKiB <= 0 || two.threads <= 0 {
		t.Errorf("no RSS or threads read: %+v", two)
	}
}

// The subject answers every command on one line, an unknown one with an
// error, so that the bench never waits on an answer that will not come.
func TestPeersSubjectAnswersEveryCommand(t *testing.T) {
	s, err := startPeerSubject(config{host: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.quit(); err != nil {
			t.Error(err)
		}
	}()
	if _, err := s.ask("fly away"); err == nil || !strings.Contains(err.Error(), "unknown command") {
		t.Errorf("unknown command: %v", err)
	}
	if _, err := s.ask("open 127.0.0.1:1 zz"); err == nil || !strings.Contains(err.Error(), "address") {
		t.Errorf("open with a bad address: %v", err)
	}
	if _, err := s.ask("touch"); err != nil {
		t.Errorf("touch with no peer: %v", err)
	}
	st, err := s.stats()
	if err != nil {
		t.Fatal(err)
	}
	if st["goroutines"] <= 0 || st["controlconns"] != 0 {
		t.Errorf("stats: %v", st)
	}
}
