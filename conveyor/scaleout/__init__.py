"""Scale-out: engine replicas on Ray Serve behind one ingress (`conveyor serve --replicas N`).

`router` decides where a request goes (pure Python), `replica` is the Ray Serve deployment that
wraps one engine and its app, `ingress` is the HTTP front that relays to the replicas. Only
`router` can be imported without Ray installed.
"""
