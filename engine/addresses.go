package engine

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"
)

// listenHosts are where the engine listens and what it tells peers.
type listenHosts struct {
	bind      string // the address both planes listen on
	advertise string // the segment name's host; "" means the bound address
	dataHost  string // the host of the data-plane addresses in the descriptor; "" means the bound address
}

// planListenHosts resolves Host and AdvertiseHost. An advertised host given
// explicitly, or one found for a wildcard bind, names both planes; a Host
// given as a name keeps advertising that name for the control plane, as
// before, while the data plane is reached at the address it resolved to.
func planListenHosts(host, advertise string) (listenHosts, error) {
	bind, adv, err := resolveListenHost(host)
	if err != nil {
		return listenHosts{}, err
	}
	h := listenHosts{bind: bind, advertise: adv}
	advertise = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(advertise), "["), "]")
	switch {
	case advertise != "":
		if err := checkAdvertiseHost(advertise); err != nil {
			return listenHosts{}, err
		}
		h.advertise, h.dataHost = advertise, advertise
	case isWildcard(bind):
		a, err := wildcardAdvertise()
		if err != nil {
			return listenHosts{}, err
		}
		h.advertise, h.dataHost = a, a
	}
	return h, nil
}

// checkAdvertiseHost accepts an address literal or a DNS name; peers
// resolve the name themselves.
func checkAdvertiseHost(h string) error {
	if a, err := netip.ParseAddr(h); err == nil {
		if a.IsUnspecified() {
			return fmt.Errorf("advertise host %q: a wildcard address cannot be reached", h)
		}
		return nil
	}
	if len(h) > 253 {
		return fmt.Errorf("advertise host %q: too long for a DNS name", h)
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 {
			return fmt.Errorf("advertise host %q: not an address nor a DNS name", h)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Errorf("advertise host %q: not an address nor a DNS name", h)
			}
		}
	}
	return nil
}

// isWildcard reports whether addr is 0.0.0.0 or ::.
func isWildcard(addr string) bool {
	a, err := netip.ParseAddr(addr)
	return err == nil && a.IsUnspecified()
}

// isLoopbackBind reports whether only this host can reach addr.
func isLoopbackBind(addr string) bool {
	a, err := netip.ParseAddr(addr)
	return err == nil && a.Unmap().IsLoopback()
}

// wildcardAdvertise picks what to advertise for a wildcard bind: this
// machine's name when it resolves to one of its own non-loopback
// addresses (the name survives renumbering), else its first non-loopback
// address, IPv4 first.
func wildcardAdvertise() (string, error) {
	local := localAddrs()
	if name, err := os.Hostname(); err == nil && name != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", name)
		cancel()
		if err == nil {
			for _, a := range addrs {
				if _, ok := local[a.Unmap()]; ok && !a.Unmap().IsLoopback() {
					return name, nil
				}
			}
		}
	}
	var v4, v6 []netip.Addr
	for a := range local {
		switch {
		case a.IsLoopback(), a.IsLinkLocalUnicast(), a.IsUnspecified():
		case a.Is4():
			v4 = append(v4, a)
		default:
			v6 = append(v6, a)
		}
	}
	for _, l := range [][]netip.Addr{v4, v6} {
		if len(l) > 0 {
			best := l[0]
			for _, a := range l[1:] {
				if a.Less(best) {
					best = a
				}
			}
			return best.String(), nil
		}
	}
	return "", fmt.Errorf("bound to a wildcard address, and this machine has no non-loopback address to advertise: set AdvertiseHost")
}

// localAddrs are the addresses of this machine's interfaces.
func localAddrs() map[netip.Addr]struct{} {
	out := map[netip.Addr]struct{}{}
	ifaces, err := net.InterfaceAddrs()
	if err != nil {
		return out
	}
	for _, ia := range ifaces {
		if p, err := netip.ParsePrefix(ia.String()); err == nil {
			out[p.Addr().Unmap()] = struct{}{}
		}
	}
	return out
}

// dataAddr is the data-plane address bound tells peers: its port on the
// advertised host, or bound itself.
func (h listenHosts) dataAddr(bound string) string {
	if h.dataHost == "" {
		return bound
	}
	_, port, err := net.SplitHostPort(bound)
	if err != nil {
		return bound
	}
	return net.JoinHostPort(h.dataHost, port)
}
