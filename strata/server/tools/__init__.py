"""Tool calls in the server: the request's tools and tool choice checked (`request`), the model's output parsed into
calls in its family's format (`calls`; the formats' shared pieces in `blocks`, gpt-oss's harmony channels in
`harmony`)."""
