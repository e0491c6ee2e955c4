package actor_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-hpc/troupe/actor"
)

// greeter spawns rank's greeter actor.
func spawnGreeter(t testing.TB, rt *actor.Runtime) {
	t.Helper()
	props := rt.PropsFromFunc(func(c pa.Context) {
		if h, ok := c.Message().(*Hello); ok {
			c.Respond(&Greeting{Text: "hello " + h.Name})
		}
	})
	if _, err := rt.Root().SpawnNamed(props, "greeter"); err != nil {
		t.Fatal(err)
	}
}

// metricLine returns the value text of the sample of name in the
// exposition body, or "" when there is none.
func metricLine(body, name string) string {
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, name+"{"); ok {
			_, val, _ := strings.Cut(v, "} ")
			return val
		}
	}
	return ""
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return string(b)
}

// TestMetricsEndpoint serves both ranks' metrics on ports of the system's
// choosing and reads the runtime's and the transport's counters of rank 1
// after ten requests from rank 0.
func TestMetricsEndpoint(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stopJob, err := actor.StartLocal(ctx, 2, actor.Options{MetricsAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(stopJob) }
	defer stop()
	u0, u1 := rts[0].MetricsURL(), rts[1].MetricsURL()
	if u0 == "" || u1 == "" || u0 == u1 {
		t.Fatalf("metrics URLs %q and %q", u0, u1)
	}
	spawnGreeter(t, rts[1])
	const n = 10
	for range n {
		if _, err := rts[0].Request(rts[0].PID(1, "greeter"), &Hello{Name: "x"}, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	body := get(t, u1)
	for name, want := range map[string]string{
		"troupe_actor_received_total":     fmt.Sprint(n),
		"troupe_actor_sent_total":         fmt.Sprint(n),
		"troupe_actor_dead_letters_total": "0",
	} {
		if got := metricLine(body, name); got != want {
			t.Errorf("%s = %q, want %q", name, got, want)
		}
	}
	if !strings.Contains(body, `troupe_actor_received_total{rank="1"}`) {
		t.Error("rank 1's metrics do not carry rank=\"1\"")
	}
	if got := metricLine(body, "troupe_traffic_am_received_total"); got == "" || got == "0" {
		t.Errorf("troupe_traffic_am_received_total = %q after %d requests", got, n)
	}
	if got := metricLine(get(t, u0), "troupe_actor_received_total"); got != fmt.Sprint(n) {
		t.Errorf("rank 0 received %q answers, want %d", got, n)
	}
	stop()
	for _, u := range []string{u0, u1} {
		if resp, err := http.Get(u); err == nil {
			resp.Body.Close()
			t.Fatalf("%s still answers after Shutdown", u)
		}
	}
}

// TestMetricsAddrBusy: a rank whose metrics port is taken fails Init with
// an error naming the address.
func TestMetricsAddrBusy(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// One rank: in a larger job the ranks that started wait in Shutdown
	// for the one that failed (StartLocal's stop gives them 10 s).
	_, _, err = actor.StartLocal(ctx, 1, actor.Options{MetricsAddr: ln.Addr().String()})
	if err == nil || !strings.Contains(err.Error(), "rank 0") || !strings.Contains(err.Error(), ln.Addr().String()) {
		t.Fatalf("Init with a taken metrics port: %v", err)
	}
	_, _, err = actor.StartLocal(ctx, 1, actor.Options{MetricsAddr: "127.0.0.1"})
	if err == nil || !strings.Contains(err.Error(), "metrics") {
		t.Fatalf("Init with a metrics address without a port: %v", err)
	}
}

// Registering the runtime's collector with a registry of the program's
// own, next to its other metrics.
func ExampleRuntime_Collector() {
	ctx := context.Background()
	rts, stop, err := actor.StartLocal(ctx, 2, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	greeter := rts[1].PropsFromFunc(func(c pa.Context) {
		if h, ok := c.Message().(*Hello); ok {
			c.Respond(&Greeting{Text: "hello " + h.Name})
		}
	})
	if _, err := rts[1].Root().SpawnNamed(greeter, "greeter"); err != nil {
		fmt.Println(err)
		return
	}
	for range 3 {
		if _, err := rts[0].Request(rts[0].PID(1, "greeter"), &Hello{Name: "x"}, 5*time.Second); err != nil {
			fmt.Println(err)
			return
		}
	}
	c, err := rts[1].Collector()
	if err != nil {
		fmt.Println(err)
		return
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	fams, err := reg.Gather()
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, f := range fams {
		if f.GetName() == "troupe_actor_received_total" {
			m := f.GetMetric()[0]
			fmt.Printf("%s{%s=%q} %v\n", f.GetName(), m.GetLabel()[0].GetName(), m.GetLabel()[0].GetValue(), m.GetCounter().GetValue())
		}
	}
	// Output: troupe_actor_received_total{rank="1"} 3
}
