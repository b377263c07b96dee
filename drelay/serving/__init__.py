"""Serving DRelay with SGLang 0.5.23: `export` writes a drafter (and relay) in SGLang's DFlash draft
format; `plugin` registers the DRELAY speculative algorithm. Nothing else in drelay imports this
package; `plugin` needs sglang (`make setup-sglang`), `export` does not."""
