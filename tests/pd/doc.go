// Package pd holds kvferry's two-process prefill/decode (PD) tests of safe
// abort (SAFETY.md, "How we prove it"). The package has no API: the tests
// are in its _test.go files. The test process plays DECODE, the owner of KV
// slots in registered memory; it runs the test binary again as PREFILL, an
// initiator that opens decode's segment and WRITEs each request's KV pages
// into the slots decode names, layer by layer as SGLang does. The two talk
// over the child's stdin and stdout, in the manner of SGLang's bootstrap:
//
//	decode -> prefill   segment <decode segment name>
//	                    request <rid> <generation> <layers> <pages> <page bytes> <addr>...
//	prefill -> decode   prefill <prefill segment name>
//	                    planned <rid>        (every transfer of the request submitted)
//	                    done <rid> <status> <bytes confirmed> <tasks> <tasks fenced> <tasks failed otherwise> <first error, quoted>
//	                    bye <key=value>...   (after stdin closed and every request ended)
//
// Addresses are layer-major: layer 0's pages, then layer 1's, and so on.
// Decode aborts requests at random moments (fixed seeds), reuses their
// slots at once with a pattern of its own, and checks every slot against
// the pattern of its current holder.
//
// The fence rows (fence_test.go, fencesignal_test.go; SAFETY.md promise 7)
// run the same harness with a prefill that passes no request id (0 on every
// transfer, as SGLang's and vLLM's Mooncake wrappers do): decode cannot
// abort such a request, so it protects the pages with Engine.Fence of the
// request's slots (every page in every layer) and reuses them at once. A
// fence stops what was planned before it, so decode fences a request once
// the prefill said "planned" for it (TestFenceBeforeThePrefillPlanned...
// shows what lands otherwise); the pages go to later requests, which the
// prefill hears of after the fence returned (the normal flow), and none of
// those may fail.
package pd
