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
//	                    done <rid> <status> <bytes confirmed> <tasks> <first error, quoted>
//	                    bye <key=value>...   (after stdin closed and every request ended)
//
// Addresses are layer-major: layer 0's pages, then layer 1's, and so on.
// Decode aborts requests at random moments (fixed seeds), reuses their
// slots at once with a pattern of its own, and checks every slot against
// the pattern of its current holder.
package pd
