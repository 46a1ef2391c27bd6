"""The load balancer: a cache-aware, load-bounded async reverse proxy in front of kvserve servers."""
