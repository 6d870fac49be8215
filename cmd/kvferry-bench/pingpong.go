package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvferry/kvferry/engine"
)

// runPingPong measures the round trip of one small WRITE, from submit to
// completion, between two processes: the engine (a target process, this
// process the initiator) over tcp and over shm (the same-host transport;
// --protocol keeps one of them), against a raw TCP ping-pong of the same
// size (a pong process that answers each --block-size message with one
// byte), in rounds that alternate, in one run.
func runPingPong(c config) error {
	const rounds = 3
	var per time.Duration
	target, segment, buffer, err := startTarget(c)
	if err != nil {
		return err
	}
	defer stopChild(target)
	pong, pline, err := startChild(c, "pong-server", "pong ready: addr=")
	if err != nil {
		return err
	}
	defer stopChild(pong)

	// One engine per protocol: tcp, and shm (the same-host transport),
	// unless --protocol names one alone.
	protos := []string{"tcp", "shm"}
	if c.proto != "" && c.proto != "auto" {
		protos = []string{c.proto}
	}
	ctx := context.Background()
	trip := map[string]func() error{}
	for _, p := range protos {
		pc := c
		pc.proto = p
		e, local, err := pc.newEngine(c.blockSize)
		if err != nil {
			return fmt.Errorf("engine over %s: %w", p, err)
		}
		defer e.Close()
		seg, err := e.OpenSegment(ctx, segment)
		if err != nil {
			return err
		}
		fill(local, 0, c.seed)
		req := []engine.Request{{Op: engine.Write, Local: engine.AddrOf(local), Segment: seg, Remote: buffer, Length: uint64(c.blockSize)}}
		trip[p] = func() error { _, err := e.Transfer(ctx, req); return err }
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(pline, "pong ready: addr="))
	if err != nil {
		return err
	}
	defer conn.Close()
	msg, ack := make([]byte, c.blockSize), make([]byte, 1)
	trip["raw"] = func() error {
		if _, err := conn.Write(msg); err != nil {
			return err
		}
		_, err := io.ReadFull(conn, ack)
		return err
	}
	order := append(append([]string(nil), protos...), "raw")
	times := map[string][]time.Duration{}
	per = time.Duration(c.duration * float64(time.Second) / float64(len(order)*rounds))
	for round := range rounds {
		for i := range order {
			which := order[(i+round)%len(order)] // each goes first in turn
			d, err := pingFor(per, which, trip[which])
			if err != nil {
				return err
			}
			times[which] = append(times[which], d...)
		}
	}
	pr := percentiles(times["raw"])
	for _, p := range protos {
		pe := percentiles(times[p])
		fmt.Printf("RESULT mode=pingpong what=engine protocol=%s op=write bytes=%d round_trips=%d p50_us=%.1f p99_us=%.1f over_raw_p50=%.2f over_raw_p99=%.2f\n",
			p, c.blockSize, len(times[p]), pe[0], pe[1], pe[0]/pr[0], pe[1]/pr[1])
	}
	fmt.Printf("RESULT mode=pingpong what=raw-tcp bytes=%d round_trips=%d p50_us=%.1f p99_us=%.1f\n", c.blockSize, len(times["raw"]), pr[0], pr[1])
	if len(protos) == 2 {
		pt, ps := percentiles(times["tcp"]), percentiles(times["shm"])
		fmt.Printf("RESULT mode=pingpong shm_over_tcp_p50=%.2f shm_over_tcp_p99=%.2f\n", ps[0]/pt[0], ps[1]/pt[1])
	}
	return nil
}

// pingFor runs one round trip after another for d and returns their times.
func pingFor(d time.Duration, which string, once func() error) ([]time.Duration, error) {
	var ts []time.Duration
	for end := time.Now().Add(d); time.Now().Before(end); {
		t0 := time.Now()
		if err := once(); err != nil {
			return nil, fmt.Errorf("%s round trip: %w", which, err)
		}
		ts = append(ts, time.Since(t0))
	}
	return ts, nil
}

// percentiles returns p50 and p99 in microseconds.
func percentiles(d []time.Duration) [2]float64 {
	if len(d) == 0 {
		return [2]float64{}
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	at := func(p float64) float64 { return float64(d[min(len(d)-1, int(p*float64(len(d))))]) / 1e3 }
	return [2]float64{at(0.50), at(0.99)}
}

// startChild runs this binary in mode as a child process and returns it
// with the first line it prints that starts with ready.
func startChild(c config, mode, ready string) (*exec.Cmd, string, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, "", err
	}
	cmd := exec.Command(exe, "--mode", mode, "--host", c.host, "--block-size", strconv.Itoa(c.blockSize),
		"--buffer-size", strconv.Itoa(max(c.blockSize, 1<<20)), "--threads", "1", "--seed", strconv.FormatUint(c.seed, 10))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	if err := cmd.Start(); err != nil {
		return nil, "", fmt.Errorf("start the %s process: %w", mode, err)
	}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), ready) {
				lines <- sc.Text()
				break
			}
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case l := <-lines:
		return cmd, l, nil
	case <-time.After(30 * time.Second):
		stopChild(cmd)
		return nil, "", fmt.Errorf("the %s process did not say it was ready within 30 s", mode)
	}
}

// startTarget runs a target process (startChild) and returns it with its
// segment name and the address of its buffer.
func startTarget(c config) (cmd *exec.Cmd, segment string, buffer uint64, err error) {
	cmd, line, err := startChild(c, "target", "target ready: ")
	if err != nil {
		return nil, "", 0, err
	}
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, "segment="); ok {
			segment = v
		} else if v, ok := strings.CutPrefix(f, "buffer="); ok {
			buffer, _ = strconv.ParseUint(strings.TrimPrefix(v, "0x"), 16, 64)
		}
	}
	if segment == "" || buffer == 0 {
		stopChild(cmd)
		return nil, "", 0, fmt.Errorf("the target said %q", line)
	}
	return cmd, segment, buffer, nil
}

// stopChild ends a child started by startChild and reaps it.
func stopChild(cmd *exec.Cmd) {
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// runPongServer is pingpong mode's raw TCP peer: it answers each
// --block-size message with one byte, on every connection, until stopped.
func runPongServer(c config) error {
	ln, err := net.Listen("tcp", net.JoinHostPort(c.host, "0"))
	if err != nil {
		return err
	}
	defer ln.Close()
	fmt.Printf("pong ready: addr=%s\n", ln.Addr())
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		go func() {
			defer conn.Close()
			buf, ack := make([]byte, c.blockSize), []byte{1}
			for {
				if _, err := io.ReadFull(conn, buf); err != nil {
					return
				}
				if _, err := conn.Write(ack); err != nil {
					return
				}
			}
		}()
	}
}
