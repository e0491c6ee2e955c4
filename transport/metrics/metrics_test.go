package metrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"

	"github.com/troupe-hpc/troupe/transport"
)

func TestSnake(t *testing.T) {
	for in, want := range map[string]string{
		"Sent":            "sent",
		"TaggedSentBytes": "tagged_sent_bytes",
		"AMSent":          "am_sent",
		"InUCX":           "in_ucx",
		"K":               "k",
		"SGL":             "sgl",
		"IPC":             "ipc",
		"PoolHighWater":   "pool_high_water",
		"Float64Hits":     "float64_hits",
		"DeviceIPCSent":   "device_ipc_sent",
	} {
		if got := snake(in); got != want {
			t.Errorf("snake(%q) = %q, want %q", in, got, want)
		}
	}
}

type inner struct {
	Pack  int64
	ZCopy int64 `metric:"zcopy"`
}

type sample struct {
	Sent      uint64
	InUse     int `metric:",gauge"`
	Ratio     float64
	On        bool
	Reason    string // left out: not a number
	Hidden    int64  `metric:"-"`
	Renamed   int32  `metric:"other_name"`
	Scheme    inner
	Atomic    atomic.Uint64
	AtomicOn  atomic.Bool
	unexposed int
}

func TestCollectorExportsFields(t *testing.T) {
	c := New(3)
	s := &sample{Sent: 7, InUse: 2, Ratio: 0.5, On: true, Reason: "x", Hidden: 9, Renamed: 4, Scheme: inner{Pack: 5, ZCopy: 6}, unexposed: 1}
	s.Atomic.Store(11)
	s.AtomicOn.Store(true)
	if err := Add(c, "test", func() *sample { return s }); err != nil {
		t.Fatal(err)
	}
	want := `
# HELP troupe_test_atomic_on troupe metrics.sample.AtomicOn
# TYPE troupe_test_atomic_on gauge
troupe_test_atomic_on{rank="3"} 1
# HELP troupe_test_atomic_total troupe metrics.sample.Atomic
# TYPE troupe_test_atomic_total counter
troupe_test_atomic_total{rank="3"} 11
# HELP troupe_test_in_use troupe metrics.sample.InUse
# TYPE troupe_test_in_use gauge
troupe_test_in_use{rank="3"} 2
# HELP troupe_test_on troupe metrics.sample.On
# TYPE troupe_test_on gauge
troupe_test_on{rank="3"} 1
# HELP troupe_test_other_name_total troupe metrics.sample.Renamed
# TYPE troupe_test_other_name_total counter
troupe_test_other_name_total{rank="3"} 4
# HELP troupe_test_ratio_total troupe metrics.sample.Ratio
# TYPE troupe_test_ratio_total counter
troupe_test_ratio_total{rank="3"} 0.5
# HELP troupe_test_scheme_pack_total troupe metrics.sample.Scheme.Pack
# TYPE troupe_test_scheme_pack_total counter
troupe_test_scheme_pack_total{rank="3"} 5
# HELP troupe_test_scheme_zcopy_total troupe metrics.sample.Scheme.ZCopy
# TYPE troupe_test_scheme_zcopy_total counter
troupe_test_scheme_zcopy_total{rank="3"} 6
# HELP troupe_test_sent_total troupe metrics.sample.Sent
# TYPE troupe_test_sent_total counter
troupe_test_sent_total{rank="3"} 7
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	// Every collection takes a fresh snapshot.
	s.Sent, s.InUse = 8, 0
	s.Atomic.Add(1)
	if got := testutil.ToFloat64(onlyMetric(t, c, "troupe_test_sent_total")); got != 8 {
		t.Fatalf("sent after the update: %v, want 8", got)
	}
	if got := testutil.ToFloat64(onlyMetric(t, c, "troupe_test_atomic_total")); got != 12 {
		t.Fatalf("atomic after the update: %v, want 12", got)
	}
}

// onlyMetric is a collector of c's metric name alone.
func onlyMetric(t *testing.T, c *Collector, name string) prometheus.Collector {
	t.Helper()
	ms := make(chan prometheus.Metric, 100)
	c.Collect(ms)
	close(ms)
	for m := range ms {
		if strings.Contains(m.Desc().String(), `"`+name+`"`) {
			return constCollector{m}
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

type constCollector struct{ m prometheus.Metric }

func (c constCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.m.Desc() }
func (c constCollector) Collect(ch chan<- prometheus.Metric) { ch <- c.m }

func TestCollectorNilSnapshot(t *testing.T) {
	c := New(0)
	if err := Add(c, "maybe", func() *inner { return nil }); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(c); n != 0 {
		t.Fatalf("a nil snapshot gave %d metrics", n)
	}
}

func TestAddErrors(t *testing.T) {
	c := New(0)
	if err := Add(c, "int", func() int { return 1 }); !errors.Is(err, ErrField) {
		t.Errorf("a non-struct snapshot: %v", err)
	}
	if err := Add(c, "byvalue", func() struct{ A atomic.Int64 } { return struct{ A atomic.Int64 }{} }); !errors.Is(err, ErrField) || !strings.Contains(err.Error(), "pointer") {
		t.Errorf("an atomic field in a value snapshot: %v", err)
	}
	type clash struct {
		A int
		B int `metric:"a"`
	}
	if err := Add(c, "clash", func() clash { return clash{} }); !errors.Is(err, ErrField) || !strings.Contains(err.Error(), "troupe_clash_a_total") {
		t.Errorf("two fields of one name: %v", err)
	}
	if err := Add(c, "bad-name", func() inner { return inner{} }); !errors.Is(err, ErrField) || !strings.Contains(err.Error(), "not a valid metric name") {
		t.Errorf("a subsystem with a dash: %v", err)
	}
	if err := Add(c, "once", func() inner { return inner{} }); err != nil {
		t.Fatal(err)
	}
	if err := Add(c, "once", func() inner { return inner{} }); !errors.Is(err, ErrField) {
		t.Errorf("a subsystem added twice: %v", err)
	}
	// The failed Adds left nothing behind.
	if n := testutil.CollectAndCount(c); n != 2 {
		t.Fatalf("%d metrics after one good Add of two fields", n)
	}
}

func TestRankAddr(t *testing.T) {
	for _, c := range []struct {
		addr string
		rank int
		want string
	}{
		{"127.0.0.1:9400", 0, "127.0.0.1:9400"},
		{"127.0.0.1:9400", 3, "127.0.0.1:9403"},
		{":9400", 2, ":9402"},
		{"[::1]:9400", 1, "[::1]:9401"},
		{"127.0.0.1:0", 5, "127.0.0.1:0"},
	} {
		got, err := RankAddr(c.addr, c.rank)
		if err != nil || got != c.want {
			t.Errorf("RankAddr(%q, %d) = %q, %v; want %q", c.addr, c.rank, got, err, c.want)
		}
	}
	for _, bad := range []string{"9400", "host:port", "host:-1", "host:70000"} {
		if _, err := RankAddr(bad, 0); err == nil {
			t.Errorf("RankAddr(%q) accepted", bad)
		}
	}
	if _, err := RankAddr("127.0.0.1:65535", 1); err == nil {
		t.Error("a rank past port 65535 accepted")
	}
}

// scrape fetches url and parses the text exposition.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: status %d, %v\n%s", url, resp.StatusCode, err, body)
	}
	var p expfmt.TextParser
	fams, err := p.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("scrape %s: %v\n%s", url, err, body)
	}
	return fams
}

// value is the value of family name's one series, with its rank label.
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, rank int) float64 {
	t.Helper()
	f := fams[name]
	if f == nil || len(f.Metric) != 1 {
		t.Fatalf("metric %s: %v", name, f)
	}
	m := f.Metric[0]
	if len(m.Label) != 1 || m.Label[0].GetName() != "rank" || m.Label[0].GetValue() != fmt.Sprint(rank) {
		t.Fatalf("metric %s: labels %v, want rank=%d", name, m.Label, rank)
	}
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	t.Fatalf("metric %s is neither a counter nor a gauge", name)
	return 0
}

// TestServeTransport runs two in-process ranks over real UCX, exchanges
// tagged messages (eager, and large enough for the rendezvous or same-host
// zero-copy path), a truncated one and active messages, and reads rank 1's
// traffic back from its metrics endpoint, with the overlap engine off and
// on.
func TestServeTransport(t *testing.T) {
	for _, engine := range []string{"off", "on"} {
		t.Run("engine="+engine, func(t *testing.T) {
			t.Setenv(transport.OverlapEnv, engine)
			for _, size := range []int{1000, 300 << 10} {
				t.Run(fmt.Sprint(size), func(t *testing.T) { serveTransport(t, engine == "on", size) })
			}
		})
	}
}

func serveTransport(t *testing.T, engine bool, size int) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	c, err := NewTransport(ts[1])
	if err != nil {
		t.Fatal(err)
	}
	srv, err := Serve("127.0.0.1:0", c)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	before := scrape(t, srv.URL())
	if v := value(t, before, "troupe_traffic_tagged_received_total", 1); v != 0 {
		t.Fatalf("tagged messages received before any was sent: %v", v)
	}
	if before["go_goroutines"] == nil || before["process_cpu_seconds_total"] == nil {
		t.Fatal("the Go and process collectors are missing")
	}
	if on := before["troupe_overlap_offloaded_total"] != nil; on != engine {
		t.Fatalf("overlap metrics exported: %v, engine on: %v", on, engine)
	}

	const n = 5
	got := make(chan error, 1)
	delivered := make(chan struct{}, n)
	if err := ts[1].SetAMHandler(7, func(m *transport.AMMessage) { delivered <- struct{}{} }); err != nil {
		t.Fatal(err)
	}
	go func() {
		buf := make([]byte, size)
		for range n {
			if _, err := ts[1].Recv(ctx, 0, 3, buf); err != nil {
				got <- err
				return
			}
		}
		// A truncated receive moves no message.
		if _, err := ts[1].Recv(ctx, 0, 5, buf[:10]); !errors.Is(err, transport.ErrTruncated) {
			got <- fmt.Errorf("truncated receive: %v", err)
			return
		}
		got <- ts[1].Send(ctx, 0, 4, buf[:size/2])
	}()
	msg := make([]byte, size)
	for range n {
		if err := ts[0].Send(ctx, 1, 3, msg); err != nil {
			t.Fatal(err)
		}
		if err := ts[0].PostAM(1, 7, []byte("hdr"), []byte("data")); err != nil {
			t.Fatal(err)
		}
	}
	if err := ts[0].Send(ctx, 1, 5, msg[:11]); err != nil {
		t.Fatal(err)
	}
	if _, err := ts[0].Recv(ctx, 1, 4, msg); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	for range n {
		select {
		case <-delivered:
		case <-ctx.Done():
			t.Fatal("active messages not delivered")
		}
	}

	after := scrape(t, srv.URL())
	for name, want := range map[string]float64{
		"troupe_traffic_tagged_received_total":       n,
		"troupe_traffic_tagged_received_bytes_total": float64(n * size),
		"troupe_traffic_tagged_sent_total":           1,
		"troupe_traffic_tagged_sent_bytes_total":     float64(size / 2),
	} {
		if v := value(t, after, name, 1); v != want {
			t.Errorf("%s = %v, want %v", name, v, want)
		}
	}
	// The transport sends active messages of its own (same-host zero-copy
	// descriptors and acknowledgements); rank 0's five are among those
	// rank 1 received, with their 7 bytes each.
	if v := value(t, after, "troupe_traffic_am_received_total", 1); v < n {
		t.Errorf("am received %v, want at least %d", v, n)
	}
	if v := value(t, after, "troupe_traffic_am_received_bytes_total", 1); v < n*7 {
		t.Errorf("am received bytes %v, want at least %d", v, n*7)
	}
	if s0 := ts[0].TrafficStats(); s0.TaggedSent != n+1 || s0.TaggedSentBytes != int64(n*size+11) || s0.AMSent < n || s0.TaggedReceived != 1 || s0.TaggedReceivedBytes != int64(size/2) {
		t.Errorf("rank 0's traffic: %+v", s0)
	}
	// One metric of each other subsystem is there.
	for _, name := range []string{"troupe_noncontig_sent_pack_total", "troupe_regcache_entries", "troupe_any_source_in_ucx_total",
		"troupe_cma_enabled", "troupe_channel_ipc_peers", "troupe_transport_post_failed_total"} {
		value(t, after, name, 1)
	}
}

func TestServeClose(t *testing.T) {
	srv, err := Serve("127.0.0.1:0", New(0))
	if err != nil {
		t.Fatal(err)
	}
	url := srv.URL()
	scrape(t, url)
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if resp, err := http.Get(url); err == nil {
		resp.Body.Close()
		t.Fatal("the server still answers after Close")
	}
	// A second Close returns the first one's result (it waited for ever for
	// the serving goroutine's result, which the first had taken).
	second := make(chan error, 1)
	go func() { second <- srv.Close() }()
	select {
	case err := <-second:
		if err != nil {
			t.Fatalf("second Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a second Close did not return")
	}
	if _, err := Serve("256.0.0.1:1", New(0)); err == nil {
		t.Fatal("Serve on an impossible address succeeded")
	}
}
