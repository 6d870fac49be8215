package main

import (
	"bufio"
	"fmt"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// kvData makes fill write KV-like data (--data kv) instead of random bytes.
var kvData bool

// fillKV writes bf16 values shaped like attention keys and values, as they
// would stand at byte offset off: element i (of 2 bytes) is an approximately
// normal value (the sum of four uniforms) times the scale of its channel
// (i mod 128, a log-normal scale drawn from seed), rounded to bf16. Each
// value depends on its position and seed alone, so any part can be checked.
// Synthetic: no model ships with this tool; it has the byte statistics that
// make real caches compress (sign and exponent in the high byte, a narrow
// exponent range per channel, noisy low mantissa bits).
func fillKV(b []byte, off int, seed uint64) {
	var scale [128]float64
	for ch := range scale {
		// A log-normal channel scale: exp(N(0, 0.8)) / 2.
		scale[ch] = math.Exp(approxNormal(mix(uint64(ch)^seed^0xc4a7))*0.8) * 0.5
	}
	for i := 0; i < len(b); {
		pos := off + i
		e := uint64(pos / 2)
		x := float32(approxNormal(mix(e^seed)) * scale[e%128])
		u := math.Float32bits(x)
		u += 0x7fff + (u>>16)&1 // round to nearest even
		v := uint16(u >> 16)
		if pos%2 == 0 {
			b[i] = byte(v)
			if i+1 < len(b) {
				b[i+1] = byte(v >> 8)
			}
			i += 2
		} else {
			b[i] = byte(v >> 8)
			i++
		}
	}
}

// approxNormal turns 64 random bits into an approximately standard normal
// value: the sum of four 16-bit uniforms, centred and scaled.
func approxNormal(r uint64) float64 {
	s := float64(r&0xffff) + float64(r>>16&0xffff) + float64(r>>32&0xffff) + float64(r>>48)
	return (s/65535 - 2) * math.Sqrt(3)
}

// runCompress measures tcp WRITEs and READs of KV-like data with
// compression off, auto and always on (huff0), in the same run, between two
// network namespaces joined by a veth pair shaped with tc tbf at each
// --rates rate ("none": unshaped), at 64 KiB and 4 MiB per request. The
// owners and the initiator are processes of this tool (target and initiator
// modes) run inside the namespaces. The sender's setting decides: a WRITE
// row sets the initiator's, a READ row the owner's (three owners, one per
// setting, answer the READs; the WRITEs go to the one not compressing).
// Each setting runs --rounds times (3 unless given), in an order rotated
// each round, and its best run is kept. "auto z" is the share of auto's
// bytes (in its best run) that crossed compressed: it shows what auto
// decided, which the ratio alone, with runs differing by more than the
// gain, cannot. It needs root, ip and tc; the namespaces are removed
// however it ends.
func runCompress(c config) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("compress mode makes network namespaces: run it as root")
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	var ops []string
	for _, op := range strings.Split(c.ops, ",") {
		if op = strings.TrimSpace(op); op != "write" && op != "read" {
			return fmt.Errorf("--ops: %q is not write or read", op)
		}
		ops = append(ops, strings.TrimSpace(op))
	}
	tag := strconv.Itoa(os.Getpid() % 100000)
	nsA, nsB := "kvfz"+tag+"a", "kvfz"+tag+"b"
	vA, vB := "kvfz"+tag+"a", "kvfz"+tag+"b"
	ipA, ipB := "10.79.0.1", "10.79.0.2"
	run := func(args ...string) error {
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	defer func() {
		_ = exec.Command("ip", "netns", "del", nsA).Run()
		_ = exec.Command("ip", "netns", "del", nsB).Run()
	}()
	for _, cmd := range [][]string{
		{"ip", "netns", "add", nsA}, {"ip", "netns", "add", nsB},
		{"ip", "link", "add", vA, "netns", nsA, "type", "veth", "peer", "name", vB, "netns", nsB},
		{"ip", "-n", nsA, "addr", "add", ipA + "/24", "dev", vA}, {"ip", "-n", nsB, "addr", "add", ipB + "/24", "dev", vB},
		{"ip", "-n", nsA, "link", "set", vA, "up"}, {"ip", "-n", nsB, "link", "set", vB, "up"},
		{"ip", "-n", nsA, "link", "set", "lo", "up"}, {"ip", "-n", nsB, "link", "set", "lo", "up"},
	} {
		if err := run(cmd...); err != nil {
			return err
		}
	}
	settings := []string{"off", "auto", "huff0"}
	// The owners: targets of KV-like data in namespace B, one per setting
	// of what they send (READ answers).
	segments := map[string]string{}
	for _, comp := range settings {
		target, segment, err := startCompressTarget(exe, nsB, ipB, comp)
		if err != nil {
			return err
		}
		defer stopChild(target)
		segments[comp] = segment
	}
	fmt.Printf("kvferry-bench --mode compress: %s of KV-like bf16 data (synthetic, see fillKV) between %s and %s over a veth pair, 4 threads and paths, %gs a run\n",
		strings.Join(ops, " and "), ipA, ipB, c.duration)
	fmt.Printf("%-8s %-5s %8s %10s %10s %11s %8s %7s %9s\n", "link", "op", "block", "off MB/s", "auto MB/s", "huff0 MB/s", "auto/off", "auto z", "huff0/off")
	for _, rate := range strings.Split(c.shapes, ",") {
		rate = strings.TrimSpace(rate)
		for _, ns := range []struct{ ns, dev string }{{nsA, vA}, {nsB, vB}} {
			_ = exec.Command("ip", "netns", "exec", ns.ns, "tc", "qdisc", "del", "dev", ns.dev, "root").Run()
			if rate == "none" {
				continue
			}
			// A burst of a few milliseconds at the rate, as a NIC's
			// queue would hold.
			if err := run("ip", "netns", "exec", ns.ns, "tc", "qdisc", "add", "dev", ns.dev, "root", "tbf", "rate", rate,
				"burst", "4mb", "latency", "50ms"); err != nil {
				return err
			}
		}
		for _, op := range ops {
			for _, block := range []int{64 << 10, 4 << 20} {
				best, bestZ := map[string]float64{}, map[string]float64{}
				for round := 0; round < max(1, c.rounds); round++ {
					// Each round starts at the next setting: a setting
					// always run in the same slot (after the CPU-bound
					// huff0 run, say) shows a bias larger than the
					// differences measured here.
					for i := range settings {
						comp := settings[(round+i)%len(settings)]
						// The sender's setting: the initiator's for a
						// WRITE, the owner's for a READ.
						segment, initComp := segments["off"], comp
						if op == "read" {
							segment, initComp = segments[comp], "off"
						}
						gbps, zShare, err := compressRun(exe, nsA, ipA, segment, initComp, op, block, c.duration)
						if err != nil {
							return fmt.Errorf("%s, %s of %d bytes, compression %s: %w", rate, op, block, comp, err)
						}
						if gbps*1000 > best[comp] {
							best[comp], bestZ[comp] = gbps*1000, zShare
						}
					}
				}
				fmt.Printf("%-8s %-5s %8s %10.0f %10.0f %11.0f %7.2fx %6.0f%% %8.2fx\n", rate, op, sizeName(block), best["off"], best["auto"], best["huff0"],
					best["auto"]/best["off"], 100*bestZ["auto"], best["huff0"]/best["off"])
			}
		}
	}
	return nil
}

// startCompressTarget starts an owner of KV-like data in namespace ns whose
// READ answers go with compression comp, and returns it and its segment.
func startCompressTarget(exe, ns, host, comp string) (*exec.Cmd, string, error) {
	target := exec.Command("ip", "netns", "exec", ns, exe, "--mode", "target", "--host", host, "--protocol", "tcp",
		"--buffer-size", "67108864", "--data", "kv", "--compression", comp)
	target.Stderr = os.Stderr
	out, err := target.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	if err := target.Start(); err != nil {
		return nil, "", err
	}
	sc := bufio.NewScanner(out)
	var segment string
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "target ready: "); ok {
			for _, f := range strings.Fields(rest) {
				if v, ok := strings.CutPrefix(f, "segment="); ok {
					segment = v
				}
			}
			break
		}
	}
	if segment == "" {
		stopChild(target)
		return nil, "", fmt.Errorf("the target (compression %s) did not start", comp)
	}
	go func() {
		for sc.Scan() {
		}
	}()
	return target, segment, nil
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dM", n>>20)
	}
	return fmt.Sprintf("%dK", n>>10)
}

// compressRun runs one timed initiator in namespace ns and returns its GB/s
// and the share of the bytes it moved that crossed compressed.
func compressRun(exe, ns, host, segment, comp, op string, block int, seconds float64) (gbps, zShare float64, err error) {
	cmd := exec.Command("ip", "netns", "exec", ns, exe, "--mode", "initiator", "--segment", segment, "--host", host,
		"--protocol", "tcp", "--op", op, "--block-size", strconv.Itoa(block), "--threads", "4", "--batch-size", "4",
		"--buffer-size", "67108864", "--duration", strconv.FormatFloat(seconds, 'f', -1, 64), "--compression", comp, "--data", "kv")
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return 0, 0, fmt.Errorf("%v: %s", err, out)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(line, "RESULT ") {
			continue
		}
		fields := map[string]float64{}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok {
				if x, err := strconv.ParseFloat(v, 64); err == nil {
					fields[k] = x
				}
			}
		}
		gbps, ok := fields["gbps"]
		if !ok || fields["bytes"] == 0 {
			break
		}
		return gbps, fields["z_raw_bytes"] / fields["bytes"], nil
	}
	return 0, 0, fmt.Errorf("no RESULT line with gbps and bytes in %q", out)
}
