"""Serving DRelay with SGLang 0.5.23: `export` writes a drafter (and relay) in SGLang's DFlash draft
format; `plugin` registers the DRELAY speculative algorithm; `bench` holds the serve_bench stage's prompt
files and server/client commands. Nothing else in drelay imports this package; `plugin` needs sglang
(`make setup-sglang`), `export` and `bench` do not."""
