{{/*
The manifests come from deploy/ (rendered into files/ by deploy/render.sh); these helpers
read them and change only what the values name.
*/}}

{{/* The image of every container: image.repository:image.tag (default appVersion). */}}
{{- define "fabricgate.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The documents of a file under files/, as a JSON list (include returns text): comment-only
documents dropped.
*/}}
{{- define "fabricgate.documents" -}}
{{- $docs := list }}
{{- range $chunk := regexSplit "(?m)^---[ \t]*$" (.Files.Get .path) -1 }}
{{- $doc := fromYaml $chunk }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "%s: %s" $.path $doc.Error) }}
{{- end }}
{{- if $doc.kind }}
{{- $docs = append $docs $doc }}
{{- end }}
{{- end }}
{{- toJson $docs }}
{{- end }}

{{/* "k=v,k2=v2" as a map. */}}
{{- define "fabricgate.selectorMap" -}}
{{- $m := dict }}
{{- range $term := splitList "," . }}
{{- $kv := splitList "=" (trim $term) }}
{{- $_ := set $m (trim (index $kv 0)) (trim (index $kv 1)) }}
{{- end }}
{{- toJson $m }}
{{- end }}

{{/*
The knobs every workload shares, applied in place to a Deployment or DaemonSet `doc` from the
part's values `part`: the image (and the webhook's FABRICGATE_IMAGE), pull policy, extra
environment, resources merged over the shipped ones, tolerations added, priority class and
affinity replaced when set.
*/}}
{{- define "fabricgate.workload" -}}
{{- $root := .root }}
{{- $part := .part }}
{{- $pod := .doc.spec.template.spec }}
{{- $image := include "fabricgate.image" $root }}
{{- range $c := $pod.containers }}
{{- $_ := set $c "image" $image }}
{{- if $root.Values.image.pullPolicy }}
{{- $_ := set $c "imagePullPolicy" $root.Values.image.pullPolicy }}
{{- end }}
{{- range $e := $c.env | default list }}
{{- if eq $e.name "FABRICGATE_IMAGE" }}
{{- $_ := set $e "value" $image }}
{{- end }}
{{- end }}
{{- end }}
{{- $main := index $pod.containers 0 }}
{{- if $part.extraEnv }}
{{- $_ := set $main "env" (concat ($main.env | default list) $part.extraEnv) }}
{{- end }}
{{- if $part.resources }}
{{- $_ := set $main "resources" (mergeOverwrite ($main.resources | default dict) (deepCopy $part.resources)) }}
{{- end }}
{{- if $part.tolerations }}
{{- $_ := set $pod "tolerations" (concat ($pod.tolerations | default list) $part.tolerations) }}
{{- end }}
{{- if $part.priorityClassName }}
{{- $_ := set $pod "priorityClassName" $part.priorityClassName }}
{{- end }}
{{- if $part.affinity }}
{{- $_ := set $pod "affinity" (deepCopy $part.affinity) }}
{{- end }}
{{- end }}

{{/* Replace the argument starting with `prefix` of container `c` by `prefix``value`. */}}
{{- define "fabricgate.setArg" -}}
{{- $args := list }}
{{- $found := false }}
{{- range $a := .c.args }}
{{- if hasPrefix $.prefix $a }}
{{- $args = append $args (printf "%s%s" $.prefix $.value) }}
{{- $found = true }}
{{- else }}
{{- $args = append $args $a }}
{{- end }}
{{- end }}
{{- if not $found }}
{{- fail (printf "the shipped container %s has no argument %s" .c.name .prefix) }}
{{- end }}
{{- $_ := set .c "args" $args }}
{{- end }}

{{/* Every document of `docs`, each after a document separator. */}}
{{- define "fabricgate.emit" -}}
{{- range . }}
---
{{ toYaml . }}
{{- end }}
{{- end }}
