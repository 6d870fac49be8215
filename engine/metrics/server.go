package metrics

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// A listener serves the collectors of every engine of the process that
// asked for the same address: engines of one process share one port, each
// told apart by its engine label.
type listener struct {
	addr string // as bound, with the port the kernel chose
	cols collectors
	srv  *http.Server
	done chan struct{}
}

// collectors is the set of collectors a listener serves. A registry cannot
// unregister a collector whose series are unchecked (the engine's come and
// go with peers), so the listener's registry holds this one set, which
// engines join and leave.
type collectors struct {
	mu  sync.Mutex
	set map[prometheus.Collector]struct{}
}

// Describe sends nothing: the series are unchecked.
func (*collectors) Describe(chan<- *prometheus.Desc) {}

// Collect collects every member's metrics.
func (c *collectors) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	members := make([]prometheus.Collector, 0, len(c.set))
	for m := range c.set {
		members = append(members, m)
	}
	c.mu.Unlock()
	for _, m := range members {
		m.Collect(ch)
	}
}

func (c *collectors) add(m prometheus.Collector) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.set[m]; ok {
		return false
	}
	c.set[m] = struct{}{}
	return true
}

// remove takes m out and returns how many members are left.
func (c *collectors) remove(m prometheus.Collector) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.set, m)
	return len(c.set)
}

var (
	listenMu  sync.Mutex
	listeners = map[string]*listener{} // by the address asked for, and by the one bound
)

// Serve serves c at http://addr/metrics until the returned stop is called,
// and returns the address it listens on (the port the kernel chose when
// addr's is 0). Collectors served at one address (the one asked for, or the
// one a listener bound: "127.0.0.1:0" and then the port it got) share its
// listener; the last stop closes it. stop waits for the listener's
// goroutine.
func Serve(addr string, c prometheus.Collector) (bound string, stop func(), err error) {
	listenMu.Lock()
	defer listenMu.Unlock()
	l := listeners[addr]
	if l == nil {
		if l, err = listen(addr); err != nil {
			return "", nil, err
		}
		listeners[addr] = l
		listeners[l.addr] = l
	}
	if !l.cols.add(c) {
		return "", nil, fmt.Errorf("metrics at %s: collector served twice", addr)
	}
	var once sync.Once
	return l.addr, func() {
		once.Do(func() {
			listenMu.Lock()
			defer listenMu.Unlock()
			if l.cols.remove(c) == 0 {
				l.close()
				for k, v := range listeners {
					if v == l {
						delete(listeners, k)
					}
				}
			}
		})
	}, nil
}

func listen(addr string) (*listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics listener on %q: %w", addr, err)
	}
	l := &listener{addr: ln.Addr().String(), cols: collectors{set: map[prometheus.Collector]struct{}{}}, done: make(chan struct{})}
	reg := prometheus.NewRegistry()
	reg.MustRegister(&l.cols)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		// A scrape that cannot be answered in time is answered with an
		// error rather than left hanging.
		Timeout: 10 * time.Second,
		// One engine's failing collector must not hide the others'.
		ErrorHandling: promhttp.ContinueOnError,
	}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintln(w, "kvferry metrics: /metrics")
	})
	l.srv = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 5 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       time.Minute,
		MaxHeaderBytes:    16 << 10,
	}
	go func() {
		defer close(l.done)
		// Serve returns ErrServerClosed after close, or an accept error
		// that ends the listener; scrapes then fail, which the scraper
		// reports.
		_ = l.srv.Serve(ln)
	}()
	return l, nil
}

// close stops the listener: connections are closed and its goroutine has
// returned when close returns.
func (l *listener) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := l.srv.Shutdown(ctx); err != nil {
		_ = l.srv.Close()
	}
	<-l.done
}
