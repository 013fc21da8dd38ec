{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "pagedray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix. KubeRay appends suffixes to the RayService name, so keep it short. */}}
{{- define "pagedray.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pagedray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels selectors use: stable across upgrades. */}}
{{- define "pagedray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedray.labels" -}}
helm.sh/chart: {{ include "pagedray.chart" . }}
{{ include "pagedray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagedray
{{- end -}}

{{/* GPUs per worker pod: gpuWorkers.gpusPerPod, else tensorParallelSize. */}}
{{- define "pagedray.gpusPerPod" -}}
{{- $tp := int .Values.engine.tensorParallelSize -}}
{{- $gpus := int (default $tp .Values.gpuWorkers.gpusPerPod) -}}
{{- if lt $tp 1 -}}
{{- fail "engine.tensorParallelSize must be at least 1" -}}
{{- end -}}
{{- if gt $tp $gpus -}}
{{- fail (printf "engine.tensorParallelSize (%d) exceeds gpuWorkers.gpusPerPod (%d): the ranks of one engine must share a pod" $tp $gpus) -}}
{{- end -}}
{{- $gpus -}}
{{- end -}}

{{/* Worker pods for `engines` engines: ceil(engines / floor(gpusPerPod / tp)). Call with
(list $ engines). */}}
{{- define "pagedray.workerPods" -}}
{{- $root := index . 0 -}}
{{- $engines := int (index . 1) -}}
{{- $perPod := div (int (include "pagedray.gpusPerPod" $root)) (int $root.Values.engine.tensorParallelSize) -}}
{{- div (add $engines (sub $perPod 1)) $perPod -}}
{{- end -}}

{{/* build_app's arguments, from engine.* (null values left out, extraArgs last). */}}
{{- define "pagedray.appArgs" -}}
{{- $e := .Values.engine -}}
{{- $m := .Values.model -}}
{{- $args := dict
  "model" (printf "%s/%s" (trimSuffix "/" $m.mountPath) $m.path)
  "served_model_name" (default (base $m.path) $m.servedModelName)
  "tensor_parallel_size" (int $e.tensorParallelSize)
  "device" "cuda"
  "block_size" (int $e.blockSize)
  "gpu_memory_utilization" $e.gpuMemoryUtilization
  "max_num_seqs" (int $e.maxNumSeqs)
  "max_num_batched_tokens" (int $e.maxNumBatchedTokens)
  "dtype" $e.dtype
  "enable_prefix_caching" $e.enablePrefixCaching
-}}
{{- if $e.autoscaling.enabled -}}
{{- $_ := set $args "min_replicas" (int $e.autoscaling.minReplicas) -}}
{{- $_ := set $args "max_replicas" (int $e.autoscaling.maxReplicas) -}}
{{- else -}}
{{- $_ := set $args "num_replicas" (int $e.replicas) -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.numKvBlocks) -}}
{{- $_ := set $args "num_kv_blocks" (int $e.numKvBlocks) -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.kvCacheMemoryGb) -}}
{{- $_ := set $args "kv_cache_memory_gb" $e.kvCacheMemoryGb -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.routing) -}}
{{- $_ := set $args "routing" $e.routing -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.routingLoadThreshold) -}}
{{- $_ := set $args "routing_load_threshold" (int $e.routingLoadThreshold) -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.routingTierWeight) -}}
{{- $_ := set $args "routing_tier_weight" (float64 $e.routingTierWeight) -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.routingDiskWeight) -}}
{{- $_ := set $args "routing_disk_weight" (float64 $e.routingDiskWeight) -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.routingPullMinBlocks) -}}
{{- $_ := set $args "routing_pull_min_blocks" (int $e.routingPullMinBlocks) -}}
{{- end -}}
{{- if $e.toolCallParser -}}
{{- $_ := set $args "tool_call_parser" $e.toolCallParser -}}
{{- end -}}
{{- if not (kindIs "invalid" $e.maxModelLen) -}}
{{- $_ := set $args "max_model_len" (int $e.maxModelLen) -}}
{{- end -}}
{{- toYaml (mergeOverwrite $args (default dict $e.extraArgs)) -}}
{{- end -}}

{{/* The Serve config (serveConfigV2): the same application as deploy/serve/pagedray.yaml. */}}
{{- define "pagedray.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
applications:
  - name: pagedray
    route_prefix: /
    import_path: pagedray.cluster.openai_app:build_app
    args:
{{ include "pagedray.appArgs" . | indent 6 }}
{{- end -}}

{{/* The model volume, from model.source. */}}
{{- define "pagedray.modelVolume" -}}
- name: models
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required for model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required for model.source=hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- else if eq .Values.model.source "initContainer" }}
  emptyDir:
    sizeLimit: {{ .Values.model.initContainer.sizeLimit }}
{{- else }}
{{- fail (printf "model.source must be pvc, hostPath or initContainer, not %q" .Values.model.source) }}
{{- end }}
{{- end -}}

{{/* HF_TOKEN from the optional Secret. */}}
{{- define "pagedray.hfTokenEnv" -}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.secretKey }}
{{- end -}}

{{/* The init container that downloads the checkpoint (model.source=initContainer); call with
(list $ WEIGHTS): the head (WEIGHTS false) takes only the tokenizer and config files. */}}
{{- define "pagedray.modelInitContainer" -}}
{{- $root := index . 0 -}}
{{- $weights := index . 1 -}}
{{- $m := $root.Values.model -}}
initContainers:
  - name: download-model
    image: {{ $m.initContainer.image }}
    command: ["/bin/sh", "-c"]
    args:
      - >-
        pip install --no-cache-dir -q "huggingface_hub>=1.0" &&
        hf download "$REPO_ID" --revision "$REVISION" --local-dir "$TARGET"
        {{- if not $weights }}
        --exclude "*.safetensors" --exclude "*.bin" --exclude "*.pth" --exclude "*.pt"
        {{- end }}
    env:
      - name: REPO_ID
        value: {{ required "model.initContainer.repoId is required" $m.initContainer.repoId | quote }}
      - name: REVISION
        value: {{ $m.initContainer.revision | quote }}
      - name: TARGET
        value: {{ printf "%s/%s" (trimSuffix "/" $m.mountPath) $m.path | quote }}
      - name: HF_HOME
        value: /tmp/hf-home
      {{- if $root.Values.hfToken.secretName }}
      {{- include "pagedray.hfTokenEnv" $root | nindent 6 }}
      {{- end }}
    volumeMounts:
      - name: models
        mountPath: {{ $m.mountPath }}
{{- end -}}

{{/* Seconds Kubernetes waits for a stopping pod: what its replicas' drain may take (Serve's
graceful_shutdown_timeout_s: the request timeout, or an hour without one, plus 25 s for the last
streams and the margin; see cluster/engine_deployment.py), plus 5 s. Kubernetes' default, 30 s,
would kill the streams a drain lets finish. */}}
{{- define "pagedray.terminationGracePeriodSeconds" -}}
{{- $timeout := 600 -}}
{{- $extra := default dict .Values.engine.extraArgs -}}
{{- if hasKey $extra "request_timeout_s" -}}{{- $timeout = int (get $extra "request_timeout_s") -}}{{- end -}}
{{- if eq $timeout 0 -}}{{- $timeout = 3600 -}}{{- end -}}
{{- add $timeout 30 -}}
{{- end -}}
