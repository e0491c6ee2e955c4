package actor_test

import (
	"context"
	"fmt"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
)

type Hello struct{ Name string }
type Greeting struct{ Text string }

func init() {
	actor.MustRegister[Hello]()
	actor.MustRegister[Greeting]()
}

// Two ranks in one process (real UCX between them): rank 1 hosts a greeter,
// rank 0 asks it for a greeting.
func Example() {
	ctx := context.Background()
	rts, stop, err := actor.StartLocal(ctx, 2, actor.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	greeter := rts[1].PropsFromFunc(func(c pa.Context) {
		if h, ok := c.Message().(*Hello); ok {
			c.Respond(&Greeting{Text: fmt.Sprintf("hello %s, from rank %d", h.Name, rts[1].Rank())})
		}
	})
	if _, err := rts[1].Root().SpawnNamed(greeter, "greeter"); err != nil {
		fmt.Println(err)
		return
	}
	res, err := rts[0].Request(rts[0].PID(1, "greeter"), &Hello{Name: "rank 0"}, 5*time.Second)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(res.(*Greeting).Text)
	// Output: hello rank 0, from rank 1
}
