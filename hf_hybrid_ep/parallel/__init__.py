"""Process groups and what runs over them: the cluster topology, the EP × EDP mesh, gradient buckets and
their reduction, ZeRO-1, fp16 loss scaling and the cross-rank checks (replica consistency, input
agreement). Nothing here knows about routers or experts' math.
"""
