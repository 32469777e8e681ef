"""``cortex bench routing``: Cortex against sglang-router and vllm-router on the same sims.

- ``command``: the options, the run and the report's provenance;
- ``workloads``, ``text``, ``bounds``: what is sent (traces, generators, block text) and the
  infinite-cache bound of each workload (pure);
- ``scenarios``, ``churn``: the deployment variants and their churn windows (pure);
- ``contenders``, ``balancer``: how each router is deployed (processes, HAProxy, CPU pinning);
- ``client``, ``runner``: sending a workload and collecting what every request did;
- ``metrics``, ``results``: hit rates, TTFT, balance, predictions and targets (pure);
- ``report``, ``sections``: ``report.md``, ``report.json`` and the plots.
"""
